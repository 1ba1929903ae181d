"""Compiling graphs: the content-addressed cache (cache.py), the parallel scheduler and its worker
processes (scheduler.py, worker.py), and the fake process group TP graphs trace under (tracing.py)."""
