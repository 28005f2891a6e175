"""Harvest captured activations over a dataset into an on-disk store, and read them back:
`fl.harvest` streams the rows of chosen sites into one zarr v3 array per site (written by
TensorStore, the optional extra `flaxlens[harvest]`), resumable after a crash, and
`fl.open_harvest` reads them by row or as shuffled batches for training."""
