"""One rank of a spawned gloo test each: started as ``python -m workers.<name>`` by helpers.distributed.launch
(from the repository root, tests/ on PYTHONPATH); every module's ``main`` writes its results for the test."""
