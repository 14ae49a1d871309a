"""The dtypes a query may run the model in, by name: light (no torch), so the CLI offers them
and `query_config` re-exports them, while `model.query_dtype` resolves them without importing
the query methods' registry."""

DTYPES = ("auto", "float32", "bfloat16", "float16")  # the model's dtype for a query (model.query_dtype)
DTYPE = "auto"  # float32 on a CPU (the reference), bfloat16 on a GPU
