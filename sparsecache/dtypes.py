"""The dtypes a query may run the model in, by name: light (no torch), so the CLI offers them
and `query_config` re-exports them, while `model.query_dtype` resolves them without importing
the query methods' registry."""

DTYPES = ("auto", "float32", "bfloat16", "float16")  # the model's dtype for a query (model.query_dtype)
DTYPE = "auto"  # float32 on a CPU (the reference), bfloat16 on a GPU

# The encode's forward (`encode-corpus --forward-dtype`): "auto" runs it under bfloat16 autocast on
# a CPU that multiplies bfloat16 natively (`native_bf16`), the K/V within 2e-5 (K) and 1.3e-4 (V)
# NMSE of float32's, ~0.1-0.2% of the codec's own error, and float32 elsewhere (a GPU's encode is
# bound by OMP, not by the forward). Opt-in: a rerun after a crash re-batches documents, which
# moves a bfloat16 forward's K/V by bfloat16's rounding, not float32's last bit, past the crash
# tests' bounds against a fresh build; and running each chunk alone, which would fix that, is up
# to 2.6x slower on short chunks (BENCHMARKS.md, "The CPU encode's OMP, phase by phase").
FORWARD_DTYPES = ("auto", "float32", "bfloat16")
FORWARD_DTYPE = "float32"  # EncodeOptions' and EvalConfig's default


def native_bf16() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (AVX512-BF16 or AMX-BF16): where it
    has not, a bfloat16 matrix product is emulated and slower than float32's."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def check_forward_dtype(name: str) -> None:
    """Refuse a forward dtype outside FORWARD_DTYPES (ConfigError, the CLI's spelling)."""
    if name not in FORWARD_DTYPES:
        from .errors import ConfigError

        raise ConfigError(f"forward-dtype must be one of {', '.join(FORWARD_DTYPES)}, got {name!r}")


def forward_dtype(name: str, device: str) -> str:
    """The dtype the encode's forward runs in ("float32" or "bfloat16") for `name` in FORWARD_DTYPES
    on `device` ("cpu", "cuda", "cuda:N")."""
    check_forward_dtype(name)
    if name != "auto":
        return name
    return "bfloat16" if str(device) == "cpu" and native_bf16() else "float32"
