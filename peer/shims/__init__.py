# Copied into the unpacked transformers sdist by `make peer-test`: makes its tests/ a regular
# package, so that no other `tests` package on sys.path shadows it.
