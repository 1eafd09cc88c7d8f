"""The engine edge's bookkeeping has one place each, checked on the source: request ids and the
table of open streams live in engine/streams.py (StreamHost), the rules for a request no engine
can run in engine/validate.py (RequestLimits), an engine's thread in
engine/threaded.py (ThreadedEngine), the list of admission policy names in engine/config.py
(POLICY_NAMES). A second allocator, stream table, validator, engine thread or list of policy
names written into an engine (or anywhere in the package) fails here."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "scratchllm"
STREAMS, VALIDATE = "engine/streams.py", "engine/validate.py"
THREADED, CONFIG = "engine/threaded.py", "engine/config.py"
EDGE = ("engine/", "cluster/")  # the engines and the cluster's RemoteEngine
LIMIT_NAMES = {"vocab", "vocab_size", "max_model_len", "prompt_token_ids"}
POLICY_NAMES = {"priority", "fcfs"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), str(path))


def _name(node):
    """The last name of a call's function or of an attribute chain: a.b.C -> 'C'."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _stream_classes(modules):
    """RequestStream and every class that derives from it, however far down."""
    classes, grew = {"RequestStream"}, True
    while grew:
        grew = False
        for _, tree in modules:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in classes and \
                        any(_name(b) in classes for b in node.bases):
                    classes.add(node.name)
                    grew = True
    return classes


def id_allocators(name, tree):
    """A counter kept on an object (`self.x = itertools.count()`, `self._next_id += 1`): what
    allocates request ids. (A count() used inline, as an index, is no allocator.)"""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and _name(n.value.func) == "count" and \
                any(isinstance(t, ast.Attribute) for t in n.targets):
            found.append(f"{name}:{n.lineno} count()")
        if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Attribute) and "id" in n.target.attr.split("_"):
            found.append(f"{name}:{n.lineno} {n.target.attr} +=")
    return found


def stream_tables(name, tree, stream_classes):
    """A stream made (RequestStream(...) or a subclass's), or a mapping annotated to hold them."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and _name(n.func) in stream_classes:
            found.append(f"{name}:{n.lineno} {_name(n.func)}(...)")
        if isinstance(n, ast.Subscript) and _name(n.value) in ("dict", "Dict", "OrderedDict", "defaultdict") and \
                any(_name(m) in stream_classes for m in ast.walk(n.slice)):
            found.append(f"{name}:{n.lineno} a table of streams")
    return found


def request_checks(name, tree):
    """`if <something about the prompt, the vocabulary or the context>: raise ConfigError(...)`."""
    found = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.If):
            continue
        raises = [r for r in n.body if isinstance(r, ast.Raise) and isinstance(r.exc, ast.Call) and
                  _name(r.exc.func) == "ConfigError"]
        names = {_name(m) for m in ast.walk(n.test)}
        if raises and names & LIMIT_NAMES:
            found.append(f"{name}:{n.lineno} refuses on {sorted(names & LIMIT_NAMES)}")
    return found


def engine_threads(name, tree):
    """A thread made (threading.Thread(...)): an engine's own loop besides ThreadedEngine's."""
    return [f"{name}:{n.lineno} {_name(n.func)}(...)" for n in ast.walk(tree)
            if isinstance(n, ast.Call) and _name(n.func) == "Thread"]


def policy_lists(name, tree):
    """A tuple, list or set literal that names two admission policies or more."""
    return [f"{name}:{n.lineno} a list of policy names" for n in ast.walk(tree)
            if isinstance(n, (ast.Tuple, ast.List, ast.Set)) and
            len({e.value for e in n.elts if isinstance(e, ast.Constant)} & POLICY_NAMES) >= 2]


def test_request_ids_are_allocated_in_one_place():
    offences = [o for name, tree in _modules() if name != STREAMS for o in id_allocators(name, tree)]
    assert offences == []


def test_streams_are_made_and_kept_in_one_place():
    modules = list(_modules())
    classes = _stream_classes(modules)
    assert {"RequestStream", "RemoteStream"} <= classes
    offences = [o for name, tree in modules if name != STREAMS for o in stream_tables(name, tree, classes)]
    assert offences == []


def test_requests_are_validated_in_one_place():
    offences = [o for name, tree in _modules() if name.startswith(EDGE) and name != VALIDATE
                for o in request_checks(name, tree)]
    assert offences == []


def test_engine_threads_are_made_in_one_place():
    offences = [o for name, tree in _modules() if name.startswith(EDGE) and name != THREADED
                for o in engine_threads(name, tree)]
    assert offences == []


def test_policy_names_are_listed_in_one_place():
    offences = [o for name, tree in _modules() if name != CONFIG for o in policy_lists(name, tree)]
    assert offences == []


def test_the_scanners_find_a_planted_copy():
    """Each scanner finds what it looks for (so an empty result above means something)."""
    plant = ast.parse(
        "import itertools\n"
        "class Mine(RemoteStream): ...\n"
        "class Engine:\n"
        "    def __init__(self):\n"
        "        self._ids = itertools.count(1)\n"
        "        self._streams: dict[str, RequestStream] = {}\n"
        "    def submit(self, prompt_token_ids, params):\n"
        "        if max(prompt_token_ids) >= self.vocab_size:\n"
        "            raise ConfigError('out of the vocabulary')\n"
        "        self._next_id += 1\n"
        "        return Mine(f'r-{self._next_id}', self.abort)\n"
        "    def start(self):\n"
        "        self._thread = threading.Thread(target=self.run)\n"
        "        p.add_argument('--policy', choices=['priority', 'fcfs'])\n")
    classes = _stream_classes([("plant.py", plant), ("remote.py", ast.parse("class RemoteStream(RequestStream): ..."))])
    assert id_allocators("plant.py", plant) == ["plant.py:5 count()", "plant.py:10 _next_id +="]
    assert stream_tables("plant.py", plant, classes) == ["plant.py:6 a table of streams", "plant.py:11 Mine(...)"]
    assert request_checks("plant.py", plant) == ["plant.py:8 refuses on ['prompt_token_ids', 'vocab_size']"]
    assert engine_threads("plant.py", plant) == ["plant.py:13 Thread(...)"]
    assert policy_lists("plant.py", plant) == ["plant.py:14 a list of policy names"]
