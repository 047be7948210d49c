"""usproxy benchmarks (issue 9): data plane, control plane and memory, run by `python -m bench.run`."""
