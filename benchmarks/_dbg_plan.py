import dataclasses, torch, sys
sys.path.insert(0, "tests")
from quilt_attn import plan
from test_planner import workload, add_invalid
for (G, M, T, tau, imp, split) in [(2,1,4,0.5,True,False),(2,1,4,0.5,False,False),(4,1,4,0.5,True,False),(8,1,16,0.5,True,False),(2,1,64,0.5,False,False)]:
    idx, s_kv = workload("correlated", 37, 200, 24, seed=0)
    idx = add_invalid(idx, s_kv, 0.1, seed=0).cuda()
    for tl in (None,):
        kw = dict(s_kv=s_kv, topk_length=tl, group_size=G, tile=T, clip_threshold=tau, merge_level=M, importance_clip=imp, split_private=split)
        a = plan(idx, backend="cuda", **kw); b = plan(idx, backend="torch", **kw)
        bad = [f.name for f in dataclasses.fields(a) if isinstance(getattr(a, f.name), torch.Tensor) and not torch.equal(getattr(a, f.name), getattr(b, f.name))]
        print((G, M, T, imp, split), "differs:", bad)
        for f in bad[:2]:
            x, y = getattr(a, f), getattr(b, f)
            if x.shape != y.shape: print(f, x.shape, y.shape); continue
            d = (x != y).nonzero()[:5]
            print(f, d.tolist(), [x[tuple(i)].item() for i in d], [y[tuple(i)].item() for i in d])
