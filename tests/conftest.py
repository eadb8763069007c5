"""Shared fixtures and helpers for the quilt_attn tests.

Markers
-------
``gpu``        needs a CUDA GPU; skipped without one.
``interpret``  runs the Triton kernels on small shapes: on the GPU when there is one, else on the
               CPU through Triton's interpreter; skipped when neither is possible
               (no CUDA and ``TRITON_INTERPRET != "1"``).

Tolerances
----------
``TOLERANCES`` is the single table of numerical bounds for kernel outputs against the float64
reference computed on the *same* rounded inputs (so input rounding is not part of the error).
With ``u`` the unit roundoff of the input dtype (fp16: 2**-11, bf16: 2**-8) the kernels make
exactly two roundings that reach ``out``:

* the softmax weights ``p = 2**(s - m)`` are rounded to the input dtype before the ``p @ V``
  product, a relative error <= u per weight (the normaliser ``l`` is summed in float32 from
  the unrounded weights);
* the float32 result is rounded to the output dtype, relative error <= u.

Elementwise, ``|out - ref| <= u * sum_j w_j |v_j| + u * |ref|``; with ``|v| <~ 4`` (Gaussian
data) this is <= 4u + u|ref|, hence ``atol = 4u, rtol = 2u``. Over a whole tensor the weight
errors have random signs, so the relative L2 error is about ``u / sqrt(3) * sqrt(2)`` ~ 0.8u;
the bound ``rel_l2 = 2.5u`` (fp16 1.2e-3, bf16 9.8e-3, i.e. the "1e-2" bf16 bound) leaves a factor
~3 of margin. The logits ``q . k`` are products of dtype values, exact in float32, summed in
float32 over d_qk <= 576 terms: for the data used here (|s| <~ 20 natural-log units) the worst
case is a few 1e-4. lse additionally takes the log of a float32 sum of <= 2048 positive terms
(relative error <= 2048 * 2**-24 ~ 1.2e-4, i.e. 1.2e-4 in natural log); the kernels keep base-2
state and the public functions multiply by ln 2 once (one float32 rounding, ~2e-6 at |lse| ~ 20).
``stat_atol`` (1.4e-3 natural-log units, for both dtypes) bounds ``|max_logits - ref|`` and
``|lse - ref|`` of the natural-log values every public function returns (FlashMLA's convention); it
is 5x tighter than the ~7e-3 a bf16-input kernel is usually held to, because the reference sees the
same rounded inputs and only float32 accumulation differs. Raw kernel launches (base 2) are compared
after ``natural_stats``.

Observed on an H200 (bf16, d_qk 576, s_q 512, topk 2048, h 1..128, dense and FP8, both methods):
out rel-L2 1.93e-3 to 1.94e-3 (bound 9.8e-3), max |out - ref| <= 1.6e-3, max_logits <= 5.0e-6 and
lse <= 1.3e-6 off (natural-log units; bound 1.4e-3).
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import settings as _hyp_settings

from quilt_attn.tolerances import FP8_MODE_TOL, FP8_MODE_VS_EXACT_REL_L2, SHAPE_ROUNDING, TOLERANCES, Tol  # noqa: F401  (for the tests)
from quilt_attn.workloads import indexer_aligned_inputs  # noqa: F401  (re-exported for the tests)

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Device on which the (small) kernel tests run: the GPU when present, else the CPU interpreter.
KERNEL_DEVICE = torch.device("cuda") if HAS_CUDA and not INTERPRET else torch.device("cpu")
KERNELS_CAN_RUN = HAS_CUDA or INTERPRET

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)




def pytest_configure(config):
    config.addinivalue_line("markers", "interpret: runs the Triton kernels (GPU, or CPU with TRITON_INTERPRET=1)")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_interp = pytest.mark.skip(reason="kernels need CUDA or TRITON_INTERPRET=1 (run `make test`)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpret" in item.keywords and not KERNELS_CAN_RUN:
            item.add_marker(skip_interp)


# ----------------------------------------------------------------------------- inputs
def gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(*shape, seed: int, dtype=torch.float16, device="cpu", scale: float = 1.0) -> torch.Tensor:
    """Gaussian data drawn on the CPU (same numbers on every device), never exactly zero."""
    x = torch.randn(*shape, generator=gen(seed), dtype=torch.float64) * scale
    x = torch.where(x == 0, torch.full_like(x, 1e-3), x)
    return x.to(dtype).to(device)


def random_indices(s_q: int, s_kv: int, topk: int, *, seed: int, device="cpu") -> torch.Tensor:
    """int32 ``[s_q, topk]``, each row ``topk`` distinct rows of ``[0, s_kv)`` (duplicate-free)."""
    g = gen(seed)
    assert topk <= s_kv
    rows = torch.argsort(torch.rand(s_q, s_kv, generator=g), dim=1)[:, :topk]
    return rows.to(torch.int32).to(device)


def make_inputs(s_q=16, h=4, s_kv=96, topk=40, *, d_qk=80, d_v=64, dtype=torch.float16, device=None,
                seed=0, indices=None):
    """Random ``q [s_q, h, d_qk]``, ``kv [s_kv, d_qk]`` and duplicate-free ``indices [s_q, topk]``."""
    device = KERNEL_DEVICE if device is None else device
    q = randn(s_q, h, d_qk, seed=seed, dtype=dtype, device=device)
    kv = randn(s_kv, d_qk, seed=seed + 1, dtype=dtype, device=device)
    if indices is None:
        indices = random_indices(s_q, s_kv, topk, seed=seed + 2, device=device)
    return q, kv, indices.to(device)


# ----------------------------------------------------------------------------- call arguments
PLAN_KEYS = ("group_size", "tile", "clip_threshold", "importance_clip", "merge_level", "split_private", "fallback")
TRITON_KEYS = ("dv_split", "num_warps", "num_stages", "fp8_expand")


def prefill_kw(**kw) -> dict:
    """``sparse_prefill`` keywords from flat ones: the planner settings among them (``PLAN_KEYS``) become
    ``settings=PlanSettings(...)``, the private Triton tuning (``TRITON_KEYS``) ``_triton={...}``; the rest pass
    as given. Lets a test name one setting, ``run(..., group_size=4)``."""
    from quilt_attn import PlanSettings

    plan = {k: kw.pop(k) for k in PLAN_KEYS if k in kw}
    tuning = {k: kw.pop(k) for k in TRITON_KEYS if k in kw}
    if plan:
        kw["settings"] = PlanSettings(**plan)
    if tuning:
        kw["_triton"] = tuning
    return kw


# ----------------------------------------------------------------------------- command lines
@pytest.fixture
def restore_triton_interpret(monkeypatch):
    """A command line's ``main`` may set TRITON_INTERPRET=1 (no GPU); keep that from leaking into other tests."""
    if "TRITON_INTERPRET" in os.environ:
        monkeypatch.setenv("TRITON_INTERPRET", os.environ["TRITON_INTERPRET"])
    else:  # set first so that monkeypatch records "absent" and deletes it again afterwards
        monkeypatch.setenv("TRITON_INTERPRET", "")
        monkeypatch.delenv("TRITON_INTERPRET")


def cli_options(parser, command: str) -> list[str]:
    """The ``--`` options of ``command``'s subparser in an argparse ``parser``."""
    import argparse

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [o for a in sub.choices[command]._actions for o in a.option_strings if o.startswith("--")]


def check_help_mentions_every_option(main, parser, command: str, capsys) -> None:
    """``main([command, "--help"])`` exits 0 and its text names every option of the subcommand (``--quiet`` too)."""
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    options = cli_options(parser, command)
    assert "--help" in options and "--quiet" in options
    for option in options:
        assert option in out, f"{command} --help does not mention {option}"


def check_bad_argument_named(main, argv, needle: str, capsys) -> None:
    """``main(argv)`` stops parsing with exit status 2 and an error naming ``needle`` (the argument)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "error" in err


# ----------------------------------------------------------------------------- NaN poisoning
@pytest.fixture
def nan_poison(monkeypatch):
    """Make ``torch.empty`` return NaN-filled floating tensors for the duration of a test.

    The kernel launcher allocates ``out``, ``max_logits`` and ``lse`` with ``torch.empty``; any
    element the kernel fails to write then stays NaN and fails the comparison.
    """
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point() and t.device.type != "meta":
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    return real_empty


# ----------------------------------------------------------------------------- CUDA backend on the CPU
@pytest.fixture
def cuda_stand_in(monkeypatch):
    """Run the CUDA backend's dispatch on the CPU: its kernel is replaced by the Triton pass it mirrors
    (same arguments, outputs written in place) and ``dispatch.choose_backend`` resolves to ``"cuda"`` (a CPU tensor
    cannot pass its device check). Returns the list of the plans the stand-in ran (None: query programs), the
    repair pass (``queue``) not among them. ``cuda_backend.TILE`` becomes 16, the tile of the CPU tests."""
    from quilt_attn import dispatch
    from quilt_attn.ops import cuda_backend
    from quilt_attn.ops.sparse_attention import _launch

    seen = []

    def stand_in(q, kv, sm_scale, out, max_logits, lse, *, indices=None, topk_length=None, plan=None,
                 attn_sink=None, partial=False, repair=None, queue=None, counter=None):
        # a work counter handed to a launch is one zeroed int32 word (the queue's spare word, zeroed with it)
        assert counter is None or (counter.dtype == torch.int32 and counter.numel() == 1 and int(counter) == 0)
        assert kv.dim() == 2 and (kv.dtype == q.dtype or (kv.dtype == torch.uint8 and cuda_backend.FP8_IN_KERNEL)), \
            "the CUDA kernel reads dense kv of q's dtype (or, widened in the kernel, the FP8 cache)"
        if queue is not None:  # the repair pass: the queued queries over their own rows
            assert plan is None and repair is None and not partial
            _launch(q, kv, sm_scale, out.shape[-1], out, max_logits, lse, indices=indices, topk_length=topk_length,
                    attn_sink=attn_sink, repair=queue, repair_pass=True)
            return
        seen.append(plan)
        _launch(q, kv, sm_scale, out.shape[-1], out, max_logits, lse, indices=indices, topk_length=topk_length,
                plan=plan, attn_sink=None if partial else attn_sink, partial=partial, repair=repair)

    monkeypatch.setattr(cuda_backend, "launch", stand_in)
    monkeypatch.setattr(cuda_backend, "TILE", 16)
    monkeypatch.setattr(dispatch, "choose_backend",
                        lambda backend, *a, **k: "triton" if backend == "triton" else "cuda")
    return seen


# ----------------------------------------------------------------------------- comparisons
def natural_stats(got):
    """``(out, max_logits, lse)`` of a raw kernel launch (base-2 statistics, as the kernels keep them) with
    max_logits / lse in natural-log units, as the public functions return them (copies; ``got`` unchanged)."""
    out, ml, lse = got
    return out, ml * LN2, lse * LN2


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    den = torch.linalg.vector_norm(ref)
    num = torch.linalg.vector_norm(x - ref)
    return float(num / den) if den > 0 else float(num)


def assert_matches_reference(got, ref, dtype, *, tol: Tol | None = None, what: str = ""):
    """``got`` / ``ref`` are ``(out, max_logits, lse)``; every element is checked.

    out: finite and within ``atol + rtol |ref|`` elementwise, and within ``rel_l2`` overall;
    max_logits / lse: the same infinities at the same places (empty rows), finite entries within
    ``stat_atol``; no NaN anywhere.
    """
    tol = tol or TOLERANCES[dtype]
    out, ml, lse = got
    r_out, r_ml, r_lse = (t.to(out.device) for t in ref)
    tag = f"[{what}] " if what else ""
    assert out.dtype == dtype, f"{tag}out dtype {out.dtype}"
    assert out.shape == r_out.shape and ml.shape == r_ml.shape and lse.shape == r_lse.shape, tag + "shapes"
    assert ml.dtype == torch.float32 and lse.dtype == torch.float32, tag + "max_logits / lse must be float32"
    for name, t in (("out", out), ("max_logits", ml), ("lse", lse)):
        assert not torch.isnan(t).any(), f"{tag}{name} has {int(torch.isnan(t).sum())} NaN (unwritten?)"
    assert torch.isfinite(out).all(), tag + "out not finite"
    o, ro = out.double(), r_out.double()
    err = (o - ro).abs()
    bound = tol.atol + tol.rtol * ro.abs()
    bad = err > bound
    if bad.any():
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(f"{tag}out: {int(bad.sum())}/{bad.numel()} elements out of tolerance; max err "
                             f"{float(err.max()):.3e}; first at {first}: got {float(o[first]):.6g}, "
                             f"expected {float(ro[first]):.6g}")
    e = rel_l2(o, ro)
    assert e <= tol.rel_l2, f"{tag}out rel-L2 {e:.3e} > {tol.rel_l2:.3e}"
    for name, t, r in (("max_logits", ml, r_ml), ("lse", lse, r_lse)):
        inf_ref = torch.isinf(r)
        assert torch.equal(torch.isinf(t), inf_ref), f"{tag}{name}: infinities differ"
        assert torch.equal(t[inf_ref], r[inf_ref]), f"{tag}{name}: signs of infinities differ"
        if (~inf_ref).any():
            d = (t[~inf_ref].double() - r[~inf_ref].double()).abs().max()
            assert d <= tol.stat_atol, f"{tag}{name}: max abs err {float(d):.3e} > {tol.stat_atol}"
    return e


# CI runs the property tests with a fixed example sequence: a red CI run is reproducible.
_hyp_settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    _hyp_settings.load_profile("ci")
