"""The model side: load a checkpoint (`loader`), own each MLA attention module's forward (`adapter`) so every layer
writes its latent through a format's cache and reads attention from it (`session`), the DSA indexer's top-k
(`indexer`), greedy decode steps (`decode_steps`), YaRN (`rope_scaling`) and random-weight models (`random_models`)."""
