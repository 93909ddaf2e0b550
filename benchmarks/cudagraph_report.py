"""A pytest plugin for benchmarks/gpu_check.sh: after the CUDA tests, how many times Inductor ran a graph
without capturing it as a CUDA graph (torch's `cudagraph_skips` counter; TORCH_LOGS=perf_hints gives the
reasons). Used as `python3 -m pytest -p benchmarks.cudagraph_report ...`."""


def pytest_terminal_summary(terminalreporter):
    from torch._dynamo.utils import counters

    terminalreporter.write_line(f"cudagraph_skips: {counters['inductor']['cudagraph_skips']}")


if __name__ == "__main__":  # a plugin, not a command: --help says how it is used
    import argparse

    usage = "python3 -m pytest -p benchmarks.cudagraph_report TESTS"
    argparse.ArgumentParser(description=__doc__, usage=usage).parse_args()
