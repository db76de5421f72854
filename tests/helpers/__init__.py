"""What the tests share: parameters and tolerances (support), the float64 truths (support, truth), ring cases,
the gloo launcher (distributed), tiny sentence-transformers models, the compile-only Triton driver, and
open_clip's loss module. Imported as ``helpers.<module>``: tests/ is on the path (pyproject.toml's pytest
``pythonpath``; tests/helpers/distributed.py puts it on the workers' PYTHONPATH)."""
