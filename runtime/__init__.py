"""clover.runtime: token trees, acceptance, the speculate -> verify loop, backends and the Generator.

The core (tree, sampling, acceptance, output, loop, generator) imports neither torch nor model code;
backends adapt engines to it and are imported lazily by name.
"""
