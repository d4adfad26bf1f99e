"""slicebroker: GPU-time budgets, fair share and contract-bound GPU slices."""

__version__ = "0.1.0"
