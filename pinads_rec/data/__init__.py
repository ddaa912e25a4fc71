"""Data, one package per job: the planted-truth generator (synth/), raw logs shaped as public datasets
(shaped_logs/), the build from raw logs (build/), a dataset's inspection (inspect/) and the Parquet
loader (loader/); beside them, at this level, the modules the writers and the readers share (the
build's manifest in build_output, page_checksums, the raw sources, the vocabularies...)."""
