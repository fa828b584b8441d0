"""tuning: Optuna sweeps under a fixed (ε, δ) on Ray. Not built yet: see issue D.

Nothing here is importable functionality; the package exists so that the top-level layout
of the project is fixed from the start.
"""
