"""Dictionaries: sparse autoencoders, transcoders and cross-layer transcoders as NNX modules;
training them on harvested or streamed activations, evaluating them against the model,
reading and writing their files (ours and the layouts other libraries publish), and
looking at what a feature does. Public as `flaxlens.dictionaries`."""
