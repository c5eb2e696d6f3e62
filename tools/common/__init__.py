"""What the benchmark (``tools/bench``) and the fidelity benchmark (``tools/fidelity``) share, below both: the
hosts' UNets (``host``), the device and dtype choice (``device``), timing and memory (``measure``), the machine
and versions a run reports (``machine``) and the ToDo reference patch (``todo_reference``). Nothing here imports
either tool."""
