"""SM clock, power draw and the driver's clock-limit reasons while the CUDA kernel runs back to back.

The boundary timelines count SM cycles; the kernel's milliseconds also depend on the clock the board
holds under load. This samples ``nvidia-smi`` every 100 ms while one case runs for ``--seconds`` (after a
warm-up of the same length), so that a cycle saving can be told from a clock change. The case's output is
checked against the float32 reference once.

    python benchmarks/power_clock.py --out pc.json [--cases glm53-like:64,glm53-like:16] [--seconds 4]
"""
import argparse
import statistics
import subprocess
import sys
import time

import torch

from quilt_attn import bench
from quilt_attn.bench import Case, make_inputs, save

FIELDS = ("clocks.sm", "power.draw", "power.limit", "temperature.gpu", "clocks_event_reasons.active")

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--out", required=True)
p.add_argument("--cases", default="glm53-like:64,glm53-like:16")
p.add_argument("--seconds", type=float, default=4.0)
a = p.parse_args()


def sample(run, seconds):
    """Runs ``run`` back to back for ``seconds`` while nvidia-smi samples; returns (calls, rows of FIELDS)."""
    cmd = ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits", "-lms", "100"]
    smi = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    t0, calls = time.time(), 0
    while time.time() - t0 < seconds:
        for _ in range(20):
            run()
        torch.cuda.synchronize()
        calls += 20
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    return calls, [[x.strip() for x in ln.split(",")] for ln in lines if ln.count(",") == len(FIELDS) - 1]


rows = []
for spec in a.cases.split(","):
    wl, h = spec.split(":")
    case = Case(wl, int(h))
    inp = make_inputs(case, n_sets=1)
    q, kv = inp.sets[0]
    call, out, ml, lse = bench.cuda_call(inp, case.h, bench.cuda_work(inp, case.h))
    run = lambda: call(q, kv)  # noqa: E731
    run()
    torch.cuda.synchronize()
    chk = bench.check(inp, out, ml, lse)
    sample(run, a.seconds)  # warm-up: the board settles
    t0 = time.time()
    calls, smp = sample(run, a.seconds)
    ms = (time.time() - t0) * 1e3 / calls
    num = lambda i: [float(r[i]) for r in smp if r[i].replace(".", "", 1).isdigit()]  # noqa: E731
    reasons = sorted({r[4] for r in smp})
    row = dict(workload=wl, h=case.h, backend="cuda", ms_wall=ms, rel_err=chk["rel_err"], nan=chk["nan"],
               samples=len(smp), sm_clock_mhz=statistics.median(num(0)), power_w=statistics.median(num(1)),
               power_limit_w=statistics.median(num(2)), temperature_c=statistics.median(num(3)),
               clock_reasons=reasons)
    rows.append(row)
    print(f"{wl} h={case.h}: {ms:.3f} ms a call (wall), rel_err {chk['rel_err']:.2e}, nan {chk['nan']}; "
          f"SM clock {row['sm_clock_mhz']:.0f} MHz, {row['power_w']:.0f} / {row['power_limit_w']:.0f} W, "
          f"{row['temperature_c']:.0f} C, reasons {reasons}")
    if chk["nan"] or chk["rel_err"] > 2e-2:
        sys.exit(f"{spec}: output check failed")
save(rows, a.out, {"command": "python " + " ".join(sys.argv)})
