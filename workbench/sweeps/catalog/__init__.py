"""The sweeps, one module per notebook group; each module registers its sweeps when imported."""
