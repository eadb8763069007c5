"""The benchmark helpers the kernel tools share, ``quilt_bench.bench`` (CPU: the work argument; the launch itself
needs the GPU)."""
import pytest
import torch

from quilt_bench import bench
from quilt_bench.bench import Case, cuda_call, cuda_work, make_inputs


def _inputs(h):
    return make_inputs(Case("glm53-like", h, s_q=32, s_kv=512, topk=128, dtype="fp16"), n_sets=1, device="cpu")


@pytest.mark.parametrize("h,merge", [(8, 8), (16, 4), (32, 2)])
def test_cuda_work_plans_below_64_heads_at_merge_level_64_over_h(h, merge):
    inp = _inputs(h)
    work = cuda_work(inp, h)
    assert list(work) == ["plan"]
    pl = work["plan"]
    # sparse_prefill's default group: the queries one program holds
    assert (pl.merge_level, pl.group_size, pl.s_q, pl.topk) == (merge, merge, 32, 128)
    assert not pl.split_private  # the CUDA kernel runs every tile as a 64-row product
    wide = cuda_work(inp, h, group_size=8)["plan"]
    assert (wide.merge_level, wide.group_size) == (merge, 8)


@pytest.mark.parametrize("h", [64, 128])
def test_cuda_work_runs_query_programs_from_64_heads(h):
    inp = _inputs(h)
    work = cuda_work(inp, h)
    assert list(work) == ["indices"] and work["indices"] is inp.indices


def test_cuda_call_poisons_its_outputs():
    inp = _inputs(16)
    call, out, max_logits, lse = cuda_call(inp, 16, dict(indices=inp.indices))
    assert callable(call)
    assert out.shape == (32, 16, 512) and out.dtype == torch.float16 and bool(out.isnan().all())
    assert max_logits.shape == lse.shape == (32, 16) and max_logits.dtype == lse.dtype == torch.float32


def test_plans_equal_compares_every_tensor_field():
    from quilt_attn import plan as make_plan
    from quilt_bench.bench import plans_equal

    idx = _inputs(8).indices
    a = make_plan(idx, s_kv=512, merge_level=8, backend="torch")
    assert plans_equal(a, make_plan(idx, s_kv=512, merge_level=8, backend="torch"))
    b = make_plan(idx, s_kv=512, merge_level=8, backend="torch")
    b.tile_kv[0, 0, 0] += 1
    assert not plans_equal(a, b)
    split = make_plan(idx, s_kv=512, merge_level=8, split_private=True, backend="torch")
    assert a.priv_idx is None and split.priv_idx is not None and not plans_equal(a, split)


def test_interleaved_rounds_alternate_the_order_and_time_each_once_a_round():
    """Every function runs once a round (time_ms on the CPU: one call), round 0 in the given order, round 1
    reversed, and so on; the result keeps one time a round per name."""
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = bench.interleaved_rounds(fns, rounds=3)
    if torch.cuda.is_available():  # (do_bench calls each function many times a round)
        assert calls[0] == "a" and calls[-1] == "c"
    else:
        assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert list(times) == ["a", "b", "c"]
    assert all(len(v) == 3 and all(t >= 0 for t in v) for v in times.values())


def test_ab_row_text_carries_the_median_rounds_and_check():
    row = dict(ms=1.5, rounds_ms=[1.4, 1.5, 1.6], rel_err=2e-3, lse_err=1e-6, max_logits_err=3e-6, nan=False)
    line = bench.ab_row_text("glm53-like", 16, "base", row)
    assert "1.500 ms" in line and "'1.400', '1.500', '1.600'" in line and "rel_err 2.00e-03" in line
    assert line.startswith("glm53-like  h=16") and "nan False" in line
