"""Where a program boundary's time goes in the CUDA kernel: a measurement build (QUILT_TIMELINE) stamps
clock64 at fixed points of each CTA's programs, one thread a role (results of that launch are checked
against the float32 reference like any other). The points are named slots (QUILT_TIMELINE_SLOTS in
quilt_attn/ops/csrc/sm90_measure.cuh), read here by name from the library's table. Per boundary
(program k-1 -> k of a CTA), in SM cycles:

  epilogue        warpgroup 0's last block done -> its output written             consumers
  wg1 lag         warpgroup 0's last block done -> warpgroup 1's                  consumers
  sum wait        warpgroup 0's last block done -> both row sums exchanged        consumers
  q_free seen     warpgroup 0's last block done -> producer past its q_free wait  producer
                  (q_free: both warpgroups' last QK done; negative: before the last block ends)
  q issue         producer issues the q copies                                    producer
  q landed        copies issued or epilogue done -> consumers past q_ready                          consumers wait
  first QK0       q ready -> warpgroup 0's first S = Q K0^T done                   (also waits for kv block 0)
  first QK1       q ready -> warpgroup 1's first S done
  block           a steady block: (end of blocks - first QK0) / (blocks - 1)

    python benchmarks/run.py boundary-timeline --out tl.json [--cases glm53-like:64,glm53-like:16]
"""
import argparse
import ctypes
import statistics
import sys

import numpy as np
import torch

from quilt_attn.ops import cuda_backend
from quilt_bench import bench
from quilt_bench.bench import Case, make_inputs, save


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="glm53-like:64,glm53-like:16")
    p.add_argument("--skip", type=int, default=0,
                   help="measurement only: 1 leaves out the kv gather, 2 the matrix products (output not checked)")
    a = p.parse_args(argv)
    lib_path = cuda_backend.build(defines=("-DQUILT_TIMELINE",))
    cuda_backend.use_library(lib_path)
    lib = ctypes.CDLL(str(lib_path))
    dims = (ctypes.c_int * 3)()
    lib.quilt_sm90_timeline_shape(dims)
    n_cta, n_prog, n_slot = dims[0], dims[1], dims[2]
    # the slots' names, in slot order, from the kernel's table (QUILT_TIMELINE_SLOTS in csrc/sm90_measure.cuh)
    lib.quilt_sm90_timeline_slots.restype = ctypes.c_char_p
    slots = lib.quilt_sm90_timeline_slots().decode().rstrip(",").split(",")
    assert len(slots) == n_slot, (slots, n_slot)
    rows = []
    for spec in a.cases.split(","):
        wl, h = spec.split(":")
        h = int(h)
        case = Case(wl, h)
        inp = make_inputs(case, n_sets=1)
        q, kv = inp.sets[0]
        work = bench.cuda_work(inp, h)
        call, out, ml, lse = bench.cuda_call(inp, h, work, _skip=a.skip)
        run = lambda: call(q, kv)  # noqa: E731
        run()
        ms = bench.time_ms(run, warmup=10, rep=50)
        assert lib.quilt_sm90_timeline_reset() == 0
        out.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        chk = bench.check(inp, out, ml, lse, base2=True) if a.skip == 0 else dict(rel_err=float("nan"), nan=None)
        buf = np.zeros(n_cta * n_prog * n_slot, dtype=np.uint64)
        assert lib.quilt_sm90_timeline(buf.ctypes.data_as(ctypes.POINTER(ctypes.c_ulonglong))) == 0
        t = buf.reshape(n_cta, n_prog, n_slot).astype(np.int64)
        ts = {name: t[:, :, i] for i, name in enumerate(slots)}  # a slot's stamps [CTA, program]
        parts = {k: [] for k in ("epilogue", "wg1_lag", "sum_wait", "q_free_seen", "q_issue", "q_landed", "first_qk0",
                                 "first_qk1", "block", "boundary")}
        spans = []
        for c in range(n_cta):
            ks = [k for k in range(n_prog) if ts["q_ready"][c, k] > 0 and ts["out_written"][c, k] > 0]
            if len(ks) < 2:
                continue
            spans.append(ts["out_written"][c, ks[-1]] - ts["q_ready"][c, ks[0]])
            for k in ks[1:]:
                if k - 1 not in ks:
                    continue
                prev = {name: v[c, k - 1] for name, v in ts.items()}
                cur = {name: v[c, k] for name, v in ts.items()}
                parts["epilogue"].append(prev["out_written"] - prev["wg0_done"])
                parts["wg1_lag"].append(prev["wg1_done"] - prev["wg0_done"])
                parts["sum_wait"].append(prev["sums_done"] - prev["wg0_done"])
                parts["q_free_seen"].append(cur["q_free_seen"] - prev["wg0_done"])
                parts["q_issue"].append(cur["q_issued"] - cur["q_free_seen"])
                parts["q_landed"].append(cur["q_ready"] - max(cur["q_issued"], prev["out_written"]))
                parts["first_qk0"].append(cur["wg0_first_qk"] - cur["q_ready"])
                if cur["wg1_first_qk"] > 0:
                    parts["first_qk1"].append(cur["wg1_first_qk"] - cur["q_ready"])
                if cur["n_blocks"] > 1:
                    parts["block"].append((cur["wg0_done"] - cur["wg0_first_qk"]) / (cur["n_blocks"] - 1))
                parts["boundary"].append(cur["wg0_first_qk"] - prev["wg0_done"])
        cyc_per_ms = statistics.median(spans) / ms  # a CTA's first-to-last stamp spans about the whole kernel
        row = dict(workload=wl, h=h, skip=a.skip, ms=ms, rel_err=chk["rel_err"], nan=chk["nan"],
                   cycles_per_us=cyc_per_ms / 1e3, boundaries=len(parts["epilogue"]), backend="cuda",
                   method="quilt" if "plan" in work else "query_parallel")
        print(f"{wl} h={h}: {ms:.3f} ms, rel_err {chk['rel_err']:.2e}, nan {chk['nan']}, {row['boundaries']} boundaries, "
              f"~{cyc_per_ms / 1e3:.0f} cycles a us")
        for k, v in parts.items():
            if v:
                med = float(np.median(v))
                row[k + "_cycles"] = med
                print(f"  {k:<12} median {med:8.0f} cycles  {med / (cyc_per_ms / 1e3):6.2f} us")
        rows.append(row)
    cuda_backend.use_library(None)
    save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
