"""kvcal's version, recorded in every bundle the runtime writes (`kvcal.version`); `kvcal.__version__` is this."""

__version__ = "0.1.0"
