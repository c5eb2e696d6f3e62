"""``python -m tools.bench``: the quick run (default), ``--full`` the whole speed benchmark, ``--fidelity`` the
fidelity benchmark, ``--dit`` ToDo on DiTs (Flux, SD3.5, Wan), ``--gpu`` the GPU table (``tools/gpu_bench.sh``).
Further flags go to the chosen one (``--full --help``, ``--fidelity --help``, ``--dit --help``, ``--gpu --help``)."""

import sys

argv = sys.argv[1:]
if argv[:1] == ["--full"]:
    from tools.bench.speed import main

    main(argv[1:])
elif argv[:1] == ["--fidelity"]:
    from tools.fidelity.run import main

    main(argv[1:])
elif argv[:1] == ["--dit"]:
    from tools.bench.dit.todo import main

    main(argv[1:])
elif argv[:1] == ["--gpu"]:
    from tools.bench.gpu import main

    main(argv[1:])
else:
    from tools.bench.quick import main

    main(argv)
