"""K/V tensors ⇄ sparse codes: layer grouping, OMP encode, bit-packed indices, decode.

A code for one signal (one token × one group of L layers) is a fixed-width row of atom
indices plus s coefficients (fp16, e4m3 or fp32). Indices are either b-bit packed in OMP's
order (b = ceil(log2 atoms), the paper's layout) or, since a code's atoms are a set, sorted
and Elias–Fano coded (~10 instead of 13 bits per index at s = 32; coefficients follow
their atoms). Decode is unpack + gather + weighted sum: on a CPU one compiled kernel over
cache-sized fp16 tiles of the atoms (`_decode_cpu`), on other devices `embedding_bag`, or
(`Codec.gpu_decode`) a matrix product of the codes scattered dense with the atoms, a sparse (CSR)
product, or a fused Triton kernel.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch

from ..errors import ConfigError
from .bitpack import ef_low_bits, pack_rows, pack_sorted_rows, unpack_rows_torch, unpack_sorted_rows_torch
from .codes import COEF_DTYPE_NAMES, INDEX_CODINGS, Codes, index_row_bytes
from .dictionary import Dictionary
from .omp import Screening, batch_omp, gram, reconstruct, reconstruct_csr, reconstruct_dense
from .signals import from_signals, to_signals

COEF_DTYPES = {"float16": torch.float16, "float32": torch.float32, "float8": torch.float8_e4m3fn}
assert tuple(COEF_DTYPES) == COEF_DTYPE_NAMES
# Coefficient formats `bench quality` compares; bytes per signal for s coefficients.
COEF_FORMATS = {"float16": lambda s: 2 * s, "float8": lambda s: s, "int8": lambda s: s + 2}
GRAPH_MAX_DIM = 384  # signal sizes up to L2 of a 3-head×64 model; see Codec.encode
# How a device other than the CPU decodes: "gather" (embedding_bag: s float32 atom rows per signal), "dense"
# (`omp.reconstruct_dense`: the codes scattered into a dense fp16 matrix, times the atoms), "csr"
# (`omp.reconstruct_csr`: the codes as a sparse CSR matrix times the atoms) or "triton" (`_decode_triton`:
# one fused kernel reading each code's fp16 atom slices from cache). The last three are candidates for large
# models, whose float32 atoms do not fit a GPU's cache (#82 item 4: the 8B shape's gather ran at 0.5% of an
# H100's bandwidth); `bench ttft --shape` times every one on a GPU (#95). Gather until measured there.
GPU_DECODES = ("gather", "dense", "csr", "triton")


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x as float8 e4m3, saturating at ±448 (a plain cast would turn larger values into NaN)."""
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def coefficient_roundtrip(coef: torch.Tensor, fmt: str) -> torch.Tensor:
    """Coefficients [N, s] as a reader gets them back from format `fmt` (float32).

    float8 is a plain e4m3 cast (coefficients of this scale fit its range without a
    per-signal scale); int8 is symmetric with one fp16 scale per signal."""
    if fmt == "float16":
        return coef.half().float()
    if fmt == "float32":
        return coef.float()
    if fmt == "int8":
        scale = (coef.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127).half().float()
        return torch.round(coef / scale).clamp(-127, 127) * scale
    if fmt == "float8":
        return to_e4m3(coef).float()
    raise ConfigError(f"coefficient format must be one of {', '.join(COEF_FORMATS)}, got {fmt!r}")


class Codec:
    """Encodes and decodes one model's K/V with one dictionary (Gram matrices built once)."""

    def __init__(self, dictionary: Dictionary, coef_dtype: str = "float16", device="cpu", indices: str = "packed",
                 screening: Screening | None = None):
        if coef_dtype not in COEF_DTYPES:
            raise ConfigError(f"coefficient dtype must be one of {', '.join(COEF_DTYPES)}, got {coef_dtype!r}")
        if indices not in INDEX_CODINGS:
            raise ConfigError(f"index coding must be one of {', '.join(INDEX_CODINGS)}, got {indices!r}")
        self.dictionary = dictionary
        self.config = dictionary.config
        self.coef_dtype = COEF_DTYPES[coef_dtype]
        self.indices = indices
        # the CPU OMP's (omp.Screening; None: the dictionary's default); exact on other devices
        self.screening = screening or Screening.default_for(dictionary.keys.shape[0], self.config.atoms)
        self.device = torch.device(device)
        self._atoms = {k: dictionary.atoms(k).to(self.device) for k in ("k", "v")}
        self._scales = {k: (None if dictionary.scale(k) is None else dictionary.scale(k).view(-1, 1, 1))
                        for k in ("k", "v")}
        self._gram: dict[str, torch.Tensor] = {}
        # Atoms on each device decoded to: a store's codec lives on the CPU, and copying the
        # atoms to the GPU on every decode cost 3.8 ms of an H100's 10 ms for 32 chunks' K.
        self._atoms_on: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._tiles: dict[str, np.ndarray] = {}  # the CPU decode's atom tiles
        self._outputs: dict[str, np.ndarray] = {}  # the CPU decode's output memory, reused (`_output`)
        self._outputs_lock = threading.Lock()
        self.cpu_kernel = True  # False: decode on the CPU as on other devices (the benchmark's baseline)
        self.gpu_decode = GPU_DECODES[0]  # off the CPU kernel: GPU_DECODES

    @property
    def bits(self) -> int:
        return self.config.index_bits

    def bytes_per_signal(self) -> int:
        return index_row_bytes(self.config, self.indices) + self.config.sparsity * self.coef_dtype.itemsize

    def gram(self, kind: str) -> torch.Tensor:
        if kind not in self._gram:
            self._gram[kind] = gram(self._atoms[kind])
        return self._gram[kind]

    def encode(self, kv: torch.Tensor, kind: str, on_block=None) -> Codes:
        """Codes of one K (pre-RoPE) or V tensor [n_layers, T, m]; `on_block(n)` as `batch_omp`'s."""
        idx, coef, (G, T) = self.omp(kv, kind, on_block)
        if self.indices == "elias-fano":
            idx, order = idx.sort(dim=1)
            coef = coef.gather(1, order)
            packed = pack_sorted_rows(idx.cpu().numpy(), self.config.atoms)
        else:
            packed = pack_rows(idx.cpu().numpy(), self.bits)
        return Codes(packed.reshape(G, T, -1), self._stored(coef).cpu().numpy().reshape(G, T, -1))

    def omp(self, kv: torch.Tensor, kind: str, on_block=None) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """OMP's atom indices and float32 coefficients [G·T, s] of one K or V tensor
        [n_layers, T, m] on the codec's device, and (G, T): the codes before storage coding."""
        kv = kv.to(self.device).float()
        if self._scales[kind] is not None:
            kv = kv * self.scales_on(kind, self.device)
        sig = to_signals(kv, self.config.layers_per_signal)  # (G, T, L·m)
        G, T, d = sig.shape
        # A CUDA graph pays where the host cannot launch kernels as fast as the GPU runs them:
        # 2.3× on 192-dim signals, but 9% slower on 960-dim ones (H100, bench omp), whose
        # larger GEMMs already keep the GPU busy.
        idx, coef = batch_omp(sig.reshape(-1, d), self._atoms[kind], self.config.sparsity, self.gram(kind),
                              graphed=d <= GRAPH_MAX_DIM, screening=self.screening, on_block=on_block)
        return idx, coef, (G, T)

    def _stored(self, coef: torch.Tensor) -> torch.Tensor:
        if self.coef_dtype == torch.float8_e4m3fn:
            return to_e4m3(coef).view(torch.uint8)
        return coef.to(self.coef_dtype)

    def decode(self, codes: Codes | tuple, kind: str, device=None, groups: slice = slice(None)) -> torch.Tensor:
        """[n_layers, T, m] float32 on `device` (default: the codec's) from Codes or (indices, coefficients).

        `groups`: which layer groups the codes are, when they are a slice of a tensor's groups
        (vLLM's connector decodes layer by layer); they are all the groups otherwise."""
        packed, coef = (codes.indices, codes.coefficients) if isinstance(codes, Codes) else codes
        dev = torch.device(device) if device is not None else self.device
        packed = torch.as_tensor(packed).to(dev)
        coef = torch.as_tensor(coef).to(dev)
        if coef.dtype == torch.uint8:  # stored e4m3 bytes
            coef = coef.view(torch.float8_e4m3fn)
        G, T, nb = packed.shape
        rows, s = packed.reshape(-1, nb), self.config.sparsity
        if self.indices == "elias-fano" and dev.type == "cpu" and self.cpu_kernel:
            idx = unpack_sorted_cpu(rows, s, self.config.atoms)
        elif self.indices == "elias-fano":
            idx = unpack_sorted_rows_torch(rows, s, self.config.atoms)
        else:
            idx = unpack_rows_torch(rows, s, self.bits)  # (G·T, s)
        return self.reconstruct(idx, coef.reshape(G * T, -1).float(), (G, T), kind, dev, groups)

    def reconstruct(self, idx: torch.Tensor, coef: torch.Tensor, shape: tuple[int, int], kind: str,
                    device: torch.device, groups: slice = slice(None)) -> torch.Tensor:
        """[n_layers, T, m] float32 on `device` from atom indices and coefficients [G·T, s]
        there (what `omp` returns), (G, T) and which layer groups they are (see `decode`)."""
        G, T = shape
        if device.type == "cpu" and self.cpu_kernel:
            return self._reconstruct_cpu(idx, coef, shape, kind, groups)
        if self.gpu_decode in ("csr", "triton"):
            self._check_indices(idx)  # neither checks its reads
            table = self.table_on(kind, device)
            if self.gpu_decode == "csr":  # a CPU's sparse product has no fp16 kernel
                sig = reconstruct_csr(idx, coef, table if device.type != "cpu" else table.float())
            else:
                from ._decode_triton import reconstruct_triton

                sig = reconstruct_triton(idx, coef, table)
        elif self.gpu_decode == "dense":
            sig = reconstruct_dense(idx, coef, self.table_on(kind, device))
        else:
            sig = reconstruct(idx, coef, self.atoms_on(kind, device))  # (G·T, L·m)
        kv = from_signals(sig.view(G, T, -1), self.config.layers_per_signal)
        if self._scales[kind] is not None:
            scale = self.scales_on(kind, device)
            L = self.config.layers_per_signal
            kv = kv.div_(scale.view(-1, L, 1, 1, 1)[groups].reshape(-1, 1, 1))
        return kv

    def _reconstruct_cpu(self, idx: torch.Tensor, coef: torch.Tensor, shape: tuple[int, int], kind: str,
                         groups: slice) -> torch.Tensor:
        """`reconstruct` on the CPU: the compiled tile kernel of `_decode_cpu` (numba, imported
        on first CPU decode: vLLM's start-up module scan trips over llvmlite, see `omp`)."""
        from ._decode_cpu import decode_tiles

        G, T = shape
        self._check_indices(idx)  # the kernel does not bounds-check its gathers
        L = self.config.layers_per_signal
        tiles = self._cpu_tiles(kind)
        m = tiles.shape[2]
        inv = (torch.ones(G * L) if self._scales[kind] is None
               else (1.0 / self._scales[kind].view(-1, L))[groups].reshape(-1))
        out = torch.from_numpy(self._output(kind, (G * L, T, m)))
        decode_tiles(idx.contiguous().numpy(), coef.float().contiguous().numpy(), tiles,
                     inv.float().contiguous().numpy(), out.numpy(), torch.get_num_threads())
        return out

    def _check_indices(self, idx: torch.Tensor) -> None:
        """Refuse atom indices outside the dictionary (damaged codes) before a decode that reads them
        unchecked: the CPU kernel, the CSR product, the Triton kernel (`embedding_bag` raises by itself)."""
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.config.atoms):
            raise ValueError(f"atom index out of range [0, {self.config.atoms}): damaged codes")

    def _output(self, kind: str, shape: tuple[int, ...]) -> np.ndarray:
        """Memory for a CPU decode's output of `shape`: the last decode's of this kind when nothing
        holds it any more (no tensor or view of it is alive) and it is large enough, else new
        (`empty_huge`), kept for the next. A decode writes ~100 MB for 8 chunks; fresh memory
        is faulted in on every decode, which on the 2-vCPU VM measured took a decode of 2,481 tokens
        from ~200 ms to 250-650 ms, varying from one query to the next (#82 item 3)."""
        from ._decode_cpu import empty_huge

        n = int(np.prod(shape))
        with self._outputs_lock:  # a server decodes from several threads
            buf = self._outputs.get(kind)
            # references: the dict's, `buf`'s and getrefcount's argument; a live result (a view) adds its own
            if buf is None or buf.size < n or sys.getrefcount(buf) > 3:
                buf = empty_huge((n,))
                self._outputs[kind] = buf
            return buf[:n].reshape(shape)

    def warm_up(self, values: int = 0) -> None:
        """Load the CPU decode's compiled kernels (~1 s once per process: numba's import and
        its cached machine code), build the atom tiles and, with `values`, fault in the memory a
        decode of that many values of each kind writes (tokens x the model's K/V values per
        token), so a query's TTFT pays none of them."""
        if not self.cpu_kernel:
            return
        s = self.config.sparsity
        for kind in ("k", "v"):
            rows = torch.arange(s, dtype=torch.int32)[None]
            self._reconstruct_cpu(rows, torch.zeros(1, s), (1, 1), kind, slice(0, 1))
            if values:
                self._output(kind, (values,)).fill(0.0)
        if self.indices == "elias-fano":
            unpack_sorted_cpu(torch.from_numpy(pack_sorted_rows(np.arange(s)[None], self.config.atoms)), s,
                               self.config.atoms)

    def _cpu_tiles(self, kind: str) -> np.ndarray:
        """The atoms of `kind` cut into one column tile per layer of a signal (see `_decode_cpu`):
        fp16 when the dictionary stores its atoms in fp16 (so exact), fp32 otherwise; built once."""
        from ._decode_cpu import atom_tiles

        if kind not in self._tiles:
            atoms = self._atoms[kind].cpu().numpy()
            width = atoms.shape[0] // self.config.layers_per_signal
            self._tiles[kind] = atom_tiles(atoms, width, self.dictionary.atoms_dtype == "float16")
        return self._tiles[kind]

    def scales_on(self, kind: str, device: torch.device) -> torch.Tensor:
        """The per-layer factors of `kind` [n_layers, 1, 1] on `device`, copied there once."""
        key = (kind + ".scales", device)
        if key not in self._atoms_on:
            self._atoms_on[key] = self._scales[kind].to(device)
        return self._atoms_on[key]

    def atoms_on(self, kind: str, device: torch.device) -> torch.Tensor:
        """The K or V atoms [L·m, n] float32 on `device`, copied there once."""
        key = (kind, device)
        if key not in self._atoms_on:
            self._atoms_on[key] = self._atoms[kind].to(device)
        return self._atoms_on[key]

    def table_on(self, kind: str, device: torch.device) -> torch.Tensor:
        """The K or V atoms as the dense decode's table Dᵀ [n, L·m], fp16 (float32 for float32
        atoms), on `device`, made once."""
        key = (kind + ".table", device)
        if key not in self._atoms_on:
            dtype = torch.float32 if self.dictionary.atoms_dtype == "float32" else torch.float16
            self._atoms_on[key] = self._atoms[kind].T.to(device, dtype).contiguous()
        return self._atoms_on[key]

    def roundtrip(self, kv: torch.Tensor, kind: str) -> torch.Tensor:
        """decode(encode(kv)): what a reader of the store gets back."""
        return self.decode(self.encode(kv, kind), kind)


def unpack_sorted_cpu(rows: torch.Tensor, count: int, universe: int) -> torch.Tensor:
    """`unpack_sorted_rows_torch` for CPU tensors, as one compiled pass over the rows (int32)."""
    from ._decode_cpu import ef_decode

    out = torch.empty(rows.shape[0], count, dtype=torch.int32)
    bad = ef_decode(rows.contiguous().numpy(), count, ef_low_bits(count, universe), out.numpy())
    if bad:
        raise ValueError(f"not Elias–Fano rows of {count} values: {bad} of {rows.shape[0]} rows")
    return out
