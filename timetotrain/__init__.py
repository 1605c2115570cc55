"""timetotrain: the MLPerf Training suite as one PyTorch-native package."""

__version__ = "0.1.0"
