"""The library's named exceptions; the CLI turns each into one line and a non-zero exit."""


class SparseCacheError(Exception):
    """Base class of every error the library raises on purpose."""


class ModelError(SparseCacheError):
    """A model cannot be loaded or is not a supported RoPE decoder."""


class DictionaryMismatch(SparseCacheError):
    """A dictionary was learned for another model, layer grouping or signal size."""


class DictionaryError(SparseCacheError):
    """A dictionary file is missing, unreadable or was written by a newer version."""


class ConfigError(SparseCacheError, ValueError):
    """A configuration value is out of range or inconsistent."""


class TextError(SparseCacheError):
    """Input text is missing, empty or unreadable."""


class StoreError(SparseCacheError):
    """A store is missing, of a newer format, or does not match the model/dictionary/config given."""


class StoreLocked(StoreError):
    """Another writer holds the store's lock."""


class StoreCorrupt(StoreError):
    """Stored data fails its checksum, is missing, or disagrees with the manifest."""


class VersionGone(StoreError):
    """The version a reader pinned was deleted (by compact or --keep) while it was being read."""


class StoreUnavailable(StoreError, ConnectionError):
    """The store did not answer: an object store unreachable or timing out, or a local disk
    error. Transient, unlike StoreCorrupt: the same read may succeed once the store is back.
    Also an OSError (ConnectionError), so code retrying I/O errors retries it."""
