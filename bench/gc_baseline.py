"""The router with CPython's default young-generation threshold (700), not the router's own
(``router_runtime.cli.GC_YOUNG_THRESHOLD``): ``bench.overhead``'s ``ours-gc700`` row runs it, to
measure what the router's threshold saves. Takes the router's arguments."""

import router_runtime.cli as cli

if __name__ == "__main__":
    cli.GC_YOUNG_THRESHOLD = 700
    cli.main()
