"""A restricted unpickler for torch state dicts: it can build a dict of tensor references, nothing else.

A pickle is a program: GLOBAL names any importable callable and REDUCE calls it, which is how a
planted `pytorch_model.bin` runs `os.system`. Here every name a pickle asks for goes through
`find_class`, which answers from a short allowlist with our own stand-ins and refuses anything
else by name, before it can be called. Nothing is imported from the names in the file: `torch`
is never imported, and the stand-ins only check their arguments and record them.

What a torch state dict pickle needs (see `scratchllm inspect` of a pytorch_model.bin):
    collections.OrderedDict                      the dict, and each tensor's empty backward hooks
    torch._utils._rebuild_tensor_v2              (storage, offset, size, stride, requires_grad, hooks)
    torch._utils._rebuild_parameter              (tensor, requires_grad, hooks) for nn.Parameter
    torch.FloatStorage, torch.HalfStorage, ...   storage types = element dtypes
and a persistent id per storage: ("storage", storage type, key, location, numel), whose bytes are
the zip entry `data/<key>`.
"""

import _compat_pickle
import collections
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from scratchllm.errors import FormatError


@dataclass(frozen=True, slots=True)  # slots: pickle's BUILD cannot rewrite a stand-in
class StorageType:
    """Stand-in for torch.FloatStorage & co.: only the element type matters."""

    name: str
    dtype: str  # our element type name: "float32", "bfloat16", ...


@dataclass(frozen=True, slots=True)  # slots: pickle's BUILD cannot rewrite a stand-in
class StorageRef:
    """A storage the pickle refers to: bytes in zip entry data/<key>, `numel` elements of `dtype`."""

    key: str
    dtype: str
    numel: int
    location: str


@dataclass(frozen=True, slots=True)  # slots: pickle's BUILD cannot rewrite a stand-in
class TensorRef:
    """A tensor = a strided view of a storage (torch's own model: offset, size and stride in elements)."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, slots=True)  # slots: pickle's BUILD cannot rewrite a stand-in
class TorchDType:
    """Stand-in for torch.float32 & co. (they appear as arguments of _rebuild_tensor_v3)."""

    name: str


STORAGE_TYPES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "UntypedStorage": "uint8",
}
TORCH_DTYPES = {
    "float64": "float64", "double": "float64", "float32": "float32", "float": "float32",
    "float16": "float16", "half": "float16", "bfloat16": "bfloat16", "int64": "int64", "long": "int64",
    "int32": "int32", "int": "int32", "int16": "int16", "short": "int16", "int8": "int8",
    "uint8": "uint8", "bool": "bool",
}


def _ints(value: object, what: str, problem: Callable[[str], FormatError]) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(type(v) is int and v >= 0 for v in value):
        raise problem(f"{what} {value!r} is not a tuple of non-negative ints")
    return tuple(value)


def _refuse_bytearray8(unpickler: pickle.Unpickler) -> None:
    # The pure-Python unpickler allocates the length the file states before reading: 2**40.
    assert isinstance(unpickler, RestrictedUnpickler)
    raise unpickler.problem("holds a BYTEARRAY8 (protocol 5): a state dict never does")


# The pure-Python unpickler: its memo is a dict. The C one's is an array as long as the largest
# memo index the file names, so a 20-byte pickle saying LONG_BINPUT 2**31 allocated 16 GiB.
class RestrictedUnpickler(pickle._Unpickler):
    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path
        self.storages: dict[str, StorageRef] = {}
        self.parameter_marker = object()
        self.allowed: dict[tuple[str, str], object] = {
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_tensor_v2,
            ("torch._utils", "_rebuild_tensor_v3"): self._rebuild_tensor_v3,
            ("torch._utils", "_rebuild_parameter"): self._rebuild_parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): self._rebuild_parameter,
            ("torch._tensor", "_rebuild_from_type_v2"): self._rebuild_from_type_v2,
            # A marker, not a class: object() has no __dict__ for BUILD to write and cannot be called.
            ("torch.nn.parameter", "Parameter"): self.parameter_marker,
        }
        for name, dtype in STORAGE_TYPES.items():
            self.allowed[("torch", name)] = StorageType(name, dtype)
        for name, dtype in TORCH_DTYPES.items():
            self.allowed[("torch", name)] = TorchDType(dtype)

    dispatch = {**pickle._Unpickler.dispatch, pickle.BYTEARRAY8[0]: _refuse_bytearray8}

    def problem(self, message: str) -> FormatError:
        return FormatError(self.path, f"data.pkl: {message}")

    def find_class(self, module: str, name: str) -> object:
        # The only door from the file to Python objects: anything not listed is refused by name.
        try:
            return self.allowed[(module, name)]
        except (KeyError, TypeError):
            raise self.problem(f"refuses global '{_py3_name(module, name)}': a state dict never needs it "
                               f"(nothing from the file was run)") from None

    def persistent_load(self, pid: object) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise self.problem(f"unknown persistent id {pid!r:.80}")
        _, storage_type, key, location, numel = pid
        if not isinstance(storage_type, StorageType):
            raise self.problem(f"storage '{key}' has type {storage_type!r:.60}, not a storage type")
        if not isinstance(key, str) or not isinstance(location, str) or type(numel) is not int or numel < 0:
            raise self.problem(f"malformed storage reference {pid!r:.80}")
        ref = StorageRef(key, storage_type.dtype, numel, location)
        if self.storages.setdefault(key, ref) != ref:
            raise self.problem(f"storage '{key}' is referenced with two different types or sizes")
        return ref

    # The rebuilders' arguments come from the file: anything at all until checked.
    def _rebuild_tensor_v2(self, storage: object, storage_offset: object, size: object, stride: object,
                           requires_grad: object = False, backward_hooks: object = None,
                           metadata: object = None) -> TensorRef:
        if not isinstance(storage, StorageRef):
            raise self.problem(f"tensor storage is {type(storage).__name__}, not a storage")
        if type(storage_offset) is not int or storage_offset < 0:
            raise self.problem(f"storage offset {storage_offset!r} is not a non-negative int")
        shape = _ints(size, "size", self.problem)
        strides = _ints(stride, "stride", self.problem)
        if len(shape) != len(strides):
            raise self.problem(f"size {shape} and stride {strides} differ in length")
        return TensorRef(storage, storage_offset, shape, strides, storage.dtype)

    def _rebuild_tensor_v3(self, storage: object, storage_offset: object, size: object, stride: object,
                           requires_grad: object, backward_hooks: object, dtype: object,
                           metadata: object = None) -> TensorRef:
        if not isinstance(dtype, TorchDType):
            raise self.problem(f"tensor dtype {dtype!r:.40} is not a torch dtype")
        ref = self._rebuild_tensor_v2(storage, storage_offset, size, stride)
        if ref.storage.dtype != "uint8" and ref.storage.dtype != dtype.name:
            raise self.problem(f"tensor dtype {dtype.name} differs from its storage's {ref.storage.dtype}")
        return TensorRef(ref.storage, ref.offset, ref.shape, ref.strides, dtype.name)

    def _rebuild_parameter(self, data: object, requires_grad: object = False, backward_hooks: object = None,
                           state: object = None) -> TensorRef:
        if not isinstance(data, TensorRef):
            raise self.problem("a Parameter that does not wrap a tensor")
        return data

    def _rebuild_from_type_v2(self, func: object, new_type: object, args: object, state: object = None) -> TensorRef:
        rebuilds = (self._rebuild_tensor_v2, self._rebuild_tensor_v3)
        if func not in rebuilds or new_type is not self.parameter_marker:
            raise self.problem("refuses to rebuild a tensor subclass other than Parameter")
        if not isinstance(args, tuple):
            raise self.problem("malformed tensor subclass arguments")
        return cast(Callable[..., TensorRef], func)(*args)  # one of `rebuilds`, checked above


def _py3_name(module: object, name: object) -> str:
    """The Python 3 name of a global, for the message: protocol-2 pickles write '__builtin__.eval'."""
    if not isinstance(module, str) or not isinstance(name, str):
        return f"{module!r:.40}.{name!r:.40}"
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    return f"{module}.{name}"[:120]


def load_state_dict_pickle(data: bytes, path: str) -> tuple[object, dict[str, StorageRef]]:
    """The unpickled object (dicts of TensorRef and plain values), and every storage it referenced."""
    unpickler = RestrictedUnpickler(data, path)
    try:
        obj = unpickler.load()
    except FormatError:
        raise
    except RecursionError:
        raise unpickler.problem("nesting too deep") from None
    except Exception as err:  # noqa: BLE001 - a malformed pickle: only our stand-ins ran, so it is the file's fault
        raise unpickler.problem(f"malformed pickle ({type(err).__name__}: {str(err)[:120]})") from None
    return obj, unpickler.storages
