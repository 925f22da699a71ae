"""Command line: ``ringattn demo | bench | launch | info`` (also
``python -m ringattn``)."""

import argparse
import sys


def _demo_parser(sub):
    d = sub.add_parser("demo", help="ring attention over local ranks, checked "
                                    "against a single-rank run")
    d.add_argument("--seq-len", "-n", type=int, default=16384)
    d.add_argument("--ranks", "-p", type=int, default=4)
    d.add_argument("--layout", default="zigzag",
                   choices=["contiguous", "zigzag", "striped"])
    d.add_argument("--backend", default="auto",
                   choices=["auto", "host", "threads"])
    d.add_argument("--batch", type=int, default=1)
    d.add_argument("--heads", type=int, default=8)
    d.add_argument("--kv-heads", type=int, default=0,
                   help="kv heads for GQA (default: --heads)")
    d.add_argument("--head-dim", type=int, default=64)
    d.add_argument("--dtype", default="float32",
                   choices=["float32", "float64", "float16", "bfloat16"])
    d.add_argument("--no-causal", action="store_true")
    d.add_argument("--samples", type=int, default=64,
                   help="rows compared with the single-rank run")
    d.add_argument("--threads", type=int, default=0,
                   help="kernel threads per rank (default: cores / ranks)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--quiet", action="store_true", help="no progress bar")


def _bench_parser(sub):
    b = sub.add_parser("bench", help="kernel and ring throughput tables")
    b.add_argument("--cpu", action="store_true", help="CPU kernel table")
    b.add_argument("--ring", action="store_true", help="ring overhead table")
    b.add_argument("--dilated", action="store_true",
                   help="dilated vs dense attention table")
    b.add_argument("--gpu", action="store_true", help="GPU kernel table")
    b.add_argument("--jax", action="store_true",
                   help="ringattn inside JAX programs vs JAX baselines")
    b.add_argument("--threads", type=int, default=0,
                   help="CPU threads (0: run single- and multi-threaded)")
    b.add_argument("--seq-lens", default="",
                   help="comma-separated sequence lengths to override")
    b.add_argument("--repeat", type=int, default=3)
    b.add_argument("--quick", action="store_true", help="small sizes")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "launch":
        from .launch import main_launch

        return main_launch(argv[1:])
    parser = argparse.ArgumentParser(
        prog="ringattn", description="torch-free ring attention")
    sub = parser.add_subparsers(dest="command")
    _demo_parser(sub)
    _bench_parser(sub)
    sub.add_parser("launch", help="ringattn launch -n N script.py [args]: start "
                                  "N ranks with the environment ra.init() reads")
    sub.add_parser("info", help="build and device information")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        return run(args)
    if args.command == "bench":
        from .bench import run

        return run(args)
    if args.command == "info":
        import ringattn as ra

        print(f"ringattn {ra.__version__}")
        print(f"cpu: {ra.cpu_info()}")
        print(f"cuda: {ra.cuda_info()}")
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
