"""Compile one guided call of the public API for sm_90 (no GPU: tests/triton_compile.py's stand-in driver) and
print each launched kernel's constexprs and resources; ``--asm DIR`` writes its TTGIR, PTX and LLVM IR.

    python tools/guided_compile_report.py --batch 1000 --dim 64 --guide-dim 384 --dtype bfloat16 --asm /tmp/asm

The compile-only view of tools/guided_fault_repro.py's case (what the launcher picks: tiles, EVEN_* flags,
ONE_CHUNK, the guide's BLOCK_G / EVEN_G / GUIDE_PRECISION).
"""

import argparse
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import triton_compile  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--guide-dim", type=int, default=384)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--symmetric", action="store_true")
    parser.add_argument("--guide-cast", action="store_true", help="the guide in the features' dtype")
    parser.add_argument("--asm", default=None, help="a folder for each kernel's ttgir / ptx / llir")
    args = parser.parse_args()
    triton_compile.init_worker()
    import torch

    import infcl

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    with triton_compile.compile_only(args.arch) as (compiled, start):
        q = torch.randn(args.batch, args.dim, generator=gen).to(dtype).requires_grad_()
        k = torch.randn(args.batch, args.dim, generator=gen).to(dtype).requires_grad_()
        guide = [torch.randn(args.batch, args.guide_dim, generator=gen) for _ in range(2)]
        guide = tuple(g.to(dtype) if args.guide_cast else g for g in guide)
        loss = infcl.cal_inf_loss(q, k, None, 10.0, symmetric=args.symmetric, backend="triton", guide=guide)
        loss.backward()
        launches = list(zip(compiled[start:], triton_compile._RECORDER.launches[start:]))
    for i, ((fn, kernel, log), launch) in enumerate(launches):
        name = triton_compile._kernel_name(fn)
        row = triton_compile._resources(fn, kernel, log, args.arch)
        flags = {key: value for key, value in launch.items() if key.isupper() or key in ("grid", "D", "DG")}
        print(f"{i} {name}: {flags}")
        print(
            f"   regs {row['regs']}, spills {row['spill_bytes']} B, smem {row['smem']} B, "
            f"{row['num_warps']} warps, {row['num_stages']} stages"
        )
        if args.asm:
            os.makedirs(args.asm, exist_ok=True)
            for ext in ("ttgir", "ptx", "llir"):
                with open(os.path.join(args.asm, f"{i}_{name}.{ext}"), "w") as out:
                    out.write(kernel.asm[ext])


if __name__ == "__main__":
    main()
