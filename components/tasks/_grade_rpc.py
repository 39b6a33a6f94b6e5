"""The program's server and the harness's end of it: functional calls and assert tests across a pipe.

Runs in the sandbox as ``_grade_rpc.py`` beside the harness's ``main.py``, which loads it by path
at start-up (before any program runs) and uses both halves: the harness side (`Server`, `Remote`,
`run_assert`, `run_functional`) in the harness's own process, the program side (`serve`) in the
server process (forked by the harness's spawner) that imports the program. Every call is a round trip whose arguments
and return value cross as plain data only (`_grade_wire.encode` / `decode`); the program's other
objects stay in its process and reach the harness as opaque handles (`Remote`). The host imports
it as ``components.tasks._grade_rpc`` only through `_grade_harness`. Standard library only.

Starting the server process is the harness's job (`_grade_harness.start_server`, passed in as
`start`): this module does not import the harness, which imports it.

Nothing here imports, runs or trusts a name the program chose: the modules the test code uses
are found from the test code alone and imported before the program's server starts
(`test_modules`); the program's own module bindings are not even reported.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time

if __package__:  # on the host
    from components.tasks._grade_wire import (MAX_MESSAGE, PROGRAM_FILE, PROGRAM_MODULE, EncodeError, decode, dumps,
                                              encode, loads)
else:  # in the sandbox: main.py registered its sibling _grade_wire in sys.modules before loading this file
    from _grade_wire import MAX_MESSAGE, PROGRAM_FILE, PROGRAM_MODULE, EncodeError, decode, dumps, encode, loads


# -- harness side: the program's server --------------------------------------------------------
class RemoteError(Exception):
    """The program raised an exception that is not a built-in one (its nearest built-in base, if any, is in the message)."""


class ProgramGone(BaseException):
    """The program's process exited, hung past the deadline, or broke the protocol.

    A BaseException, not an Exception: test code that tolerates the program's own errors
    (``try: candidate(x) except Exception: ...``) must not swallow the program's disappearance
    (a program that kills its server would otherwise skip every check inside such a ``try``).
    """


class Server:
    """The harness's end of the program's server: requests out, plain-data replies in.

    ``start(cpu_seconds, req_fd, rep_fd)`` starts the server process (`serve` on those two pipe
    ends, in a session of its own) and returns its Popen.
    """

    def __init__(self, deadline: float, cpu_seconds: float, cap: int, start):
        self.deadline = deadline
        self.cap = cap
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.proc = start(cpu_seconds, req_r, rep_w)
        os.close(req_r)
        os.close(rep_w)
        os.set_blocking(self.req_w, False)
        os.set_blocking(self.rep_r, False)
        self.pidfd = self._pidfd()
        self.buf = bytearray()
        self.seq = 0
        self.dead = None  # why the server is unusable, once it is
        self.names = self.reply(0)  # {name: description} of the program's top level

    def call(self, op: str, **fields):
        """Send one request and return the decoded reply (raising the program's exception)."""
        if self.dead:
            raise ProgramGone(self.dead)
        self._pending_args = fields.pop("_args", [])
        self.seq += 1
        data = (dumps({"seq": self.seq, "op": op, **fields}) + "\n").encode()
        self._send(data)
        try:
            return self.reply(self.seq)
        except StopIteration as err:
            if op == "next":
                raise
            # As PEP 479 does for generators: a StopIteration out of a call would end the test's
            # loop over map(candidate, ...) early, so that no check runs.
            raise RuntimeError(f"the program raised StopIteration outside of next(): {err}"[:300]) from None

    def _pidfd(self):
        """A descriptor that becomes readable when the server exits (None where there is none: then poll)."""
        try:
            return os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            return None

    def _kill(self) -> None:
        """SIGKILL the server's whole session: its supervisor, the program and what the program started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass

    def _fail(self, why: str):
        self.dead = why
        self._kill()
        raise ProgramGone(why)

    def _wait(self, fd: int, events: int) -> None:
        sel = selectors.DefaultSelector()
        sel.register(fd, events)
        if self.pidfd is not None:
            sel.register(self.pidfd, selectors.EVENT_READ)
        try:
            while True:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._fail("wall-clock timeout")
                ready = sel.select(min(left, 0.05) if self.pidfd is None else left)
                if any(key.fd == fd for key, _ in ready):
                    return
                if ready or self.proc.poll() is not None:  # the pidfd: it exited
                    return
        finally:
            sel.close()

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            self._wait(self.req_w, selectors.EVENT_WRITE)
            try:
                view = view[os.write(self.req_w, view[:65536]):]
            except BlockingIOError:
                continue
            except OSError:
                self._fail("the program exited")

    def reply(self, seq: int):
        while b"\n" not in self.buf:
            self._wait(self.rep_r, selectors.EVENT_READ)
            try:
                chunk = os.read(self.rep_r, 1 << 20)
            except BlockingIOError:
                if self.proc.poll() is not None:
                    self._fail(f"the program exited (code {self.proc.returncode})")
                continue
            if not chunk:
                self._fail("the program exited" + (f" (code {self.proc.poll()})" if self.proc.poll() is not None else ""))
            self.buf += chunk
            if len(self.buf) > MAX_MESSAGE:
                self._fail("a reply over the size limit")
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf = bytearray(rest)
        try:
            msg = loads(line)
            if not isinstance(msg, dict) or msg.get("seq") != seq:
                raise ValueError("reply out of sequence")
        except ValueError as err:
            self._fail(f"malformed reply: {err}")
        if "err" in msg:
            raise _exception(msg["err"])
        try:
            value = decode(msg.get("ok"), self._resolve)
            for i, after in msg.get("after", []):
                if type(i) is not int or not 0 <= i < len(self._pending_args):
                    raise ValueError("bad argument index")
                _write_back(self._pending_args[i], decode(after, self._resolve))
        except (ValueError, TypeError, IndexError, AttributeError) as err:
            self._fail(f"malformed reply: {err}")
        return value

    _pending_args: list = []

    def _resolve(self, tag: dict):
        if tag.get("#") != "handle" or not isinstance(tag.get("id"), int):
            raise ValueError("malformed handle")
        return Remote(self, tag["id"], str(tag.get("type", "object"))[:100])

    def request(self, op: str, target: "Remote", args=(), kwargs=None, **fields):
        """A request about a remote object; arguments are encoded here (handles of this server only)."""
        enc = lambda v: encode(v, self._ref)
        fields.update(args=[enc(a) for a in args], kwargs={k: enc(v) for k, v in (kwargs or {}).items()})
        pending = list(args) + list((kwargs or {}).values())
        return self.call(op, id=object.__getattribute__(target, "_id"), _args=pending, **fields)

    def _ref(self, x):
        if isinstance(x, Remote) and object.__getattribute__(x, "_server") is self:
            return {"#": "ref", "id": object.__getattribute__(x, "_id")}
        raise EncodeError(f"cannot pass a {type(x).__name__} to the program (only plain data and its own objects)")

    def close(self):
        self._kill()
        try:
            self.proc.wait(1)
        except subprocess.TimeoutExpired:
            pass


def _write_back(arg, after) -> None:
    """Mirror an in-place change the program made to a list / dict / set argument."""
    if type(arg) is list and type(after) is list:
        arg[:] = after
    elif type(arg) is dict and type(after) is dict:
        arg.clear()
        arg.update(after)
    elif type(arg) is set and type(after) is set:
        arg.clear()
        arg.update(after)


_MAPPED = {name for name, v in vars(builtins).items()
           if isinstance(v, type) and issubclass(v, Exception)}


def _exception(err) -> Exception:
    """The program's exception as a built-in one of the same class (or its nearest built-in base)."""
    name, message = (err + ["", ""])[:2] if isinstance(err, list) else ("", str(err))
    name, message = str(name)[:100], str(message)[:1000]
    cls = getattr(builtins, name, None) if name in _MAPPED else None
    if cls is None:
        return RemoteError(f"{name}: {message}")
    try:
        return cls(message)
    except Exception:  # a built-in exception with other required arguments
        return RemoteError(f"{name}: {message}")


class Remote:
    """A proxy for one of the program's objects: calls, attributes, iteration and the like are
    round trips; comparison with anything but another of its objects is identity (so never
    equal to plain data), and it has no truth value of its own."""

    __slots__ = ("_server", "_id", "_type")

    def __init__(self, server, hid, type_name):
        object.__setattr__(self, "_server", server)
        object.__setattr__(self, "_id", hid)
        object.__setattr__(self, "_type", type_name)

    def _req(self, op, *args, **fields):
        return object.__getattribute__(self, "_server").request(op, self, args=args, **fields)

    def __call__(self, *args, **kwargs):
        server = object.__getattribute__(self, "_server")
        return server.request("call", self, args=args, kwargs=kwargs)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._req("getattr", name=name)

    def __setattr__(self, name, value):
        self._req("setattr", value, name=name)

    def __iter__(self):
        return self._req("iter")

    def __next__(self):
        return self._req("next")

    def __len__(self):
        n = self._req("len")
        if type(n) is not int:
            raise TypeError("len() of a program object must be an int")
        return n

    def __getitem__(self, key):
        return self._req("getitem", key)

    def __contains__(self, item):
        return self._req("contains", item) is True

    def __bool__(self):
        v = self._req("bool")
        if type(v) is not bool:
            raise TypeError("bool() of a program object must be a bool")
        return v

    def __str__(self):
        return str(self._req("str"))

    def __repr__(self):
        return f"<program {object.__getattribute__(self, '_type')} object>"

    def __hash__(self):
        return hash((id(object.__getattribute__(self, "_server")), object.__getattribute__(self, "_id")))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def _compare(self, op, other):
        if not isinstance(other, Remote) or object.__getattribute__(other, "_server") is not object.__getattribute__(self, "_server"):
            return NotImplemented
        v = self._req("compare", other, name=op)
        if type(v) is not bool:
            raise TypeError(f"a comparison of program objects ({op}) must give a bool")
        return v

    def __eq__(self, other):
        if isinstance(other, Remote) and object.__getattribute__(other, "_server") is object.__getattribute__(self, "_server") \
                and object.__getattribute__(other, "_id") == object.__getattribute__(self, "_id"):
            return True
        return self._compare("eq", other)

    def __ne__(self, other):
        eq = self.__eq__(other)
        return NotImplemented if eq is NotImplemented else not eq

    __lt__ = lambda self, other: self._compare("lt", other)
    __le__ = lambda self, other: self._compare("le", other)
    __gt__ = lambda self, other: self._compare("gt", other)
    __ge__ = lambda self, other: self._compare("ge", other)


def module_names_used(tree) -> set:
    """Names the code (an ast tree) uses as modules: ``name.attr`` (``math.isclose``) for a bare `name`."""
    import ast

    return {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}


def _imported_modules(tree) -> list:
    """Dotted names of the modules the code's own import statements load (absolute imports only)."""
    import ast

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
            out += [f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*"]
    return out


def _installed(name: str) -> bool:
    """Is `name` a top-level module this interpreter has (built in, standard library or installed)?

    Looked up by the import system's finders on sys.path, which run nothing: the harness's own dir
    is off sys.path and the program's working dir was never on it."""
    import importlib.util

    try:
        return name in sys.builtin_module_names or importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# Names that stand for a module by convention, the module they stand for: a test that uses one
# without importing it (``np.allclose``) gets that module where it is installed, and never the
# program's object of that name (a class ``np`` whose ``allclose`` is always True).
CONVENTIONAL_ALIASES = {"np": "numpy", "pd": "pandas", "plt": "matplotlib.pyplot", "nx": "networkx"}


def test_modules(test_code: str, prompt_code: str = "") -> dict:
    """{name: module, or None} for the names the tests use as modules, imported here and now,
    BEFORE the program's server starts (so no import happens after any program code has run).

    From the test code and the prompt's helpers only: every module their own import statements
    load (bound again when they run, from sys.modules), and each bare name they use as a module
    (``math.isclose``) that names an installed module (`_installed`: standard library or third
    party) or is a `CONVENTIONAL_ALIASES` name, whatever the program defines under that name and
    even when it imports nothing. None for an alias whose module is not installed: the name is
    then no one's (the test fails with a NameError), never the program's."""
    import ast
    import importlib

    wanted, used = [], set()
    for source in (prompt_code or "", test_code or ""):
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue  # the tests fail when they run
        wanted += _imported_modules(tree)
        used |= module_names_used(tree)
    modules = {}
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        for name in wanted:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - not a module (a name from a module), or missing: the tests say so
                pass
        for name in sorted(used):
            module = CONVENTIONAL_ALIASES.get(name, name)
            if hasattr(builtins, name) or not (name in CONVENTIONAL_ALIASES or _installed(name)):
                continue
            modules[name] = None
            if _installed(module.split(".")[0]):
                try:
                    modules[name] = importlib.import_module(module)
                except Exception:  # noqa: BLE001 - an installed module that does not import here
                    pass
    return modules


def test_namespace(server: Server, modules: dict) -> dict:
    """Globals for the test code: the program's top-level names, as proxies or plain values, and
    the tests' `modules` (`test_modules`) over them (a name it maps to None is left undefined).

    Names of built-ins and dunders are never taken from the program (a program-defined ``abs``
    or ``AssertionError`` cannot change what the test means); a name the tests use as a module
    is the real module (a class named ``math`` whose ``isclose`` is always True cannot stand in
    for `math`); a name the program bound to a module is not taken at all.
    """
    # "__main__", as when the tests were appended to the program: a test guarded by
    # ``if __name__ == "__main__":`` runs (else nothing is checked and every program passes).
    ns = {"__name__": "__main__", "__builtins__": builtins}
    for name, info in server.names.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("__") or hasattr(builtins, name) \
                or name in modules:
            continue
        if "value" in info:
            ns[name] = info["value"]
        elif "handle" in info:
            ns[name] = info["handle"]
    ns.update({name: module for name, module in modules.items() if module is not None})
    return ns


def run_assert(header: dict, emit, start) -> None:
    """Run the assert / check(candidate) test code here, against the program's server (`start`: see `Server`)."""
    server = None
    try:
        code = header["test_code"]
        modules = test_modules(code, header.get("prompt_code") or "")  # before any program code runs
        deadline = time.monotonic() + float(header["case_wall"])
        server = Server(deadline, float(header["case_cpu"]), int(header["output_cap"]), start)
        ns = test_namespace(server, modules)
        # What the test code prints must not break the report's lines (emit keeps the real stdout).
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            if header.get("prompt_code"):  # the prompt's own helpers, not the program's (see code_file)
                exec(compile(header["prompt_code"], "<prompt>", "exec"), ns)
            exec(compile(code, "<tests>", "exec"), ns)
            entry = header.get("entry_point")
            if entry and "def check(" in code:
                # The entry point by the program's name for it, even one that a built-in has too.
                candidate = server.names.get(entry, {}).get("handle", ns.get(entry))
                if candidate is None:
                    raise NameError(f"the program does not define {entry!r}")
                ns["check"](candidate)
        if server.dead:  # the program went away in a call the tests' bare `except:` swallowed
            raise ProgramGone(server.dead)
    except BaseException as err:  # noqa: BLE001 - any failure of the tests fails the program
        emit({"verdict": "fail", "why": f"{type(err).__name__}: {err}"[:300]})
        return
    finally:
        if server is not None:
            server.close()
    emit({"verdict": "pass"})


def run_functional(header: dict, read_case, emit, start) -> None:
    """Call the program's function once per case and report its plain return values (`start`: see `Server`)."""
    wall, n = float(header["case_wall"]), int(header["n"])
    try:
        server = Server(time.monotonic() + wall, float(header["case_cpu"]) * (n + 1), int(header["output_cap"]),
                        start)
    except (ProgramGone, Exception) as err:  # noqa: BLE001
        emit({"case": 0, "ok": False, "why": f"the program did not load: {type(err).__name__}: {err}"[:300]})
        return
    try:
        for j in range(n):
            args = read_case()["args"]
            server.deadline = time.monotonic() + wall
            try:
                value = server.call("solve", fn=header["fn_name"], args=args)
                emit({"case": j, "ok": True, "value": encode(value)})
            except BaseException as err:  # noqa: BLE001
                emit({"case": j, "ok": False, "why": f"{type(err).__name__}: {err}"[:300]})
                return
    finally:
        server.close()


# -- program side: the server ------------------------------------------------------------------
def serve(req_fd: int, rep_fd: int) -> None:
    """Import the program and answer the harness's requests until its pipe closes. Never returns."""
    import types

    requests = os.fdopen(req_fd, "rb", buffering=1 << 16)
    replies = os.fdopen(rep_fd, "wb", buffering=0)
    objects: dict[int, object] = {}
    ids: dict[int, int] = {}

    def handle(x):
        key = id(x)
        if key not in ids:
            ids[key] = len(objects) + 1
            objects[ids[key]] = x
        return {"#": "handle", "id": ids[key], "type": type(x).__name__}

    def send(msg) -> None:
        replies.write((dumps(msg) + "\n").encode())

    def error(seq, err: BaseException) -> dict:
        base = next((c.__name__ for c in type(err).__mro__ if c.__name__ in _MAPPED and getattr(builtins, c.__name__) is c), None)
        name = type(err).__name__ if base is None else base
        detail = str(err) if name == type(err).__name__ else f"{type(err).__name__}: {err}"
        return {"seq": seq, "err": [name, detail[:1000]]}

    mod = types.ModuleType(PROGRAM_MODULE)
    mod.__file__ = os.path.abspath(PROGRAM_FILE)
    sys.modules[PROGRAM_MODULE] = mod
    try:
        with open(PROGRAM_FILE, encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, PROGRAM_FILE, "exec"), mod.__dict__)
        names = {}
        for name, value in list(vars(mod).items()):
            if name.startswith("__"):
                continue
            if isinstance(value, types.ModuleType):
                names[name] = {"kind": "module"}  # its name is the program's choice: not reported
                continue
            kind = "class" if isinstance(value, type) else "function" if callable(value) else "object"
            try:
                enc = encode(value)
                if len(dumps(enc)) > 1 << 16:  # a big table stays in the program's process
                    raise ValueError("large")
                names[name] = {"value": enc, "kind": "value"}
            except (EncodeError, RecursionError, ValueError):
                names[name] = {"handle": handle(value), "kind": kind}
        send({"seq": 0, "ok": {"#": "dict", "v": [[k, _describe_name(v)] for k, v in names.items()]}})
    except BaseException as err:  # noqa: BLE001 - SystemExit included: the program did not load
        send(error(0, err))
        os._exit(0)

    def resolve(tag):
        if tag.get("#") == "ref" and tag.get("id") in objects:
            return objects[tag["id"]]
        raise ValueError("unknown object reference")

    for line in requests:
        try:
            req = loads(line)
            seq = req["seq"]
        except Exception:  # noqa: BLE001
            os._exit(1)
        try:
            send(_answer(req, mod, objects, resolve, handle, seq))
        except BaseException as err:  # noqa: BLE001 - SystemExit / KeyboardInterrupt in a call too
            try:
                send(error(seq, err))
            except BaseException:  # noqa: BLE001
                os._exit(1)
    os._exit(0)


def _describe_name(info: dict):
    """One top-level name's entry in the ready message (a tagged dict)."""
    return {"#": "dict", "v": [[k, v] for k, v in info.items()]}


def _answer(req, mod, objects, resolve, handle, seq) -> dict:
    """Perform one request in the program's process; the reply carries plain data or a handle."""
    op = req["op"]
    args = [decode(a, resolve) for a in req.get("args", [])]
    kwargs = {k: decode(v, resolve) for k, v in req.get("kwargs", {}).items()}
    if op == "solve":  # a functional case: the function, or a method of Solution()
        fn = vars(mod).get(req["fn"])
        if not callable(fn):
            solution = vars(mod).get("Solution")
            if solution is None:
                raise NameError(f"name {req['fn']!r} is not defined")
            fn = getattr(solution(), req["fn"])
        return {"seq": seq, "ok": encode(fn(*args))}
    target = objects.get(req.get("id"))
    if target is None:
        raise ValueError("unknown object")
    if op == "call":
        result = target(*args, **kwargs)
    elif op == "getattr":
        result = getattr(target, req["name"])
    elif op == "setattr":
        setattr(target, req["name"], args[0])
        result = None
    elif op == "iter":
        result = iter(target)
    elif op == "next":
        result = next(target)
    elif op == "len":
        result = len(target)
    elif op == "getitem":
        result = target[args[0]]
    elif op == "contains":
        result = args[0] in target
    elif op == "bool":
        result = bool(target)
    elif op == "str":
        result = str(target)
    elif op == "compare":
        import operator

        result = getattr(operator, req["name"])(target, args[0])
        result = result if type(result) is bool else bool(result)
    else:
        raise ValueError(f"unknown request {op!r}")
    reply = {"seq": seq, "ok": encode(result, handle)}
    after = [[i, encode(a, handle)] for i, a in enumerate(list(args) + list(kwargs.values())) if type(a) in (list, dict, set)]
    if after:
        reply["after"] = after
    return reply
