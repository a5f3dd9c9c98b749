"""What a model's forward reads besides its weights: one step's batch (ForwardBatch) and the paged KV
cache it reads and writes (KVLayout). Plain data below ops/ and models/, which take them as arguments;
the engine builds them."""
