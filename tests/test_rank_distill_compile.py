"""The Triton kernels of retrieval_metrics and cal_distill_loss compile for a GPU through the public calls
(compile-only, as tests/test_triton_api_compile.py does for the losses; the calls:
tests/helpers/rank_distill_compile.py):
both rank passes with labels, ids and any_positive, the distillation loss's forward and backward symmetric
and one-directional, on sm_90 in bf16 and fp32 (INFCL_COMPILE_FULL=1: tf32, fp16, fp64 and sm_80 too),
without spills, within shared memory, without float atomics."""

import pytest

from helpers import rank_distill_compile

triton = pytest.importorskip("triton")


def test_rank_and_distill_kernels_compile_for_a_gpu():
    results = rank_distill_compile.compile_all()
    problems = rank_distill_compile.problems(results)
    assert not problems, "\n".join(problems)
    kernels = {row["kernel"] for r in results for row in r["kernels"]}
    assert kernels == {"best_positives", "ahead_counts", "distill_forward", "distill_backward"}
