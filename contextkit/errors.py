"""The exception tree users catch. Every message says what is wrong and how to fix it.

ContextKitError
├── ConfigError            a setting is invalid
├── ModelError
│   ├── ModelNotFoundError     unknown model name or missing directory
│   ├── CorruptModelError      the GGUF / weights file cannot be read or fails its checksum
│   └── UnsupportedModelError  an architecture or feature the built-in engine does not implement
├── InputError
│   ├── EmptyInputError        nothing to answer
│   └── PromptTooLongError     prompt (+ tokens to generate) exceeds the model's context
└── KVCacheError               a KV cache misuse (out of capacity, mismatched shapes)
"""

from __future__ import annotations


class ContextKitError(Exception):
    """Base class of every error contextkit raises on purpose."""


class ConfigError(ContextKitError, ValueError):
    """A configuration value is invalid."""


class ModelError(ContextKitError):
    """A model cannot be found, read or run."""


class ModelNotFoundError(ModelError, LookupError):
    """The named model is not known, or its directory does not exist."""


class CorruptModelError(ModelError):
    """A model file is unreadable, truncated or fails its checksum."""


class UnsupportedModelError(ModelError):
    """The model uses an architecture or feature the built-in engine does not implement."""


class InputError(ContextKitError, ValueError):
    """A request is malformed."""


class EmptyInputError(InputError):
    """The request has nothing to work on."""


class PromptTooLongError(InputError):
    """The prompt plus the tokens to generate do not fit the model's context window."""


class KVCacheError(ContextKitError):
    """A KV cache was used beyond its capacity or with tensors of the wrong shape."""
