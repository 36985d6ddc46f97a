"""A scripted ``torch`` whose ``torch.cuda`` mirrors how CUDA treats
devices, for the agent's device-selection tests (it never reaches a GPU).

What it mirrors (PyTorch's source and CUDA's rules):
- the current device is per thread: a new thread starts on 0, and
  ``set_device`` on one thread does not move another;
- a context is created on a device by ``set_device``, by ``mem_get_info``
  (torch makes the device current for the call) and by allocating there;
- ``device_count``, ``get_device_properties``, ``memory_stats`` /
  ``torch._C._cuda_memoryStats``, ``torch._C._cuda_hasPrimaryContext``,
  ``memory._snapshot`` and ``get_allocator_backend`` create none;
- under ``backend="cudaMallocAsync"`` the OOM observer and the memory
  history are refused (``RuntimeError``), snapshots too, and the stats keep
  only the allocated, active and reserved bytes; its OOM text is the async
  backend's.

Every call is recorded as ``(call, device, thread name)``.

    fake = fake_torch_cuda.install(devices=4)     # sys.modules["torch"]
    torch.cuda.set_device(2); torch.cuda.alloc(1 << 30)
"""

import sys
import threading
import types

GIB = 1 << 30


def uuid_bytes(device):
    return bytes([0x5D, 0x1E, 0x3B, 0x2C] + [device] * 12)


def uuid_text(device):
    h = uuid_bytes(device).hex()
    return "%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:])


class OutOfMemoryError(RuntimeError):
    pass


class _CUuuid:
    """torch 2.x's ``props.uuid``: str() without NVML's "GPU-" prefix."""

    def __init__(self, device):
        self.bytes = uuid_bytes(device)

    def __str__(self):
        return uuid_text(int(self.bytes[-1]))


class _Props:
    def __init__(self, device, total):
        self.name = "Fake H200"
        self.total_memory = total
        self.uuid = _CUuuid(device)
        self.pci_domain_id, self.pci_bus_id, self.pci_device_id = 0, 0x10 + device, 0


class FakeCuda:
    def __init__(self, devices, capacity, backend, primary_context):
        self.n, self.capacity, self.backend = devices, capacity, backend
        self.primary_context = primary_context
        self.local = threading.local()
        self.lock = threading.Lock()
        self.calls = []
        self.contexts = set()
        self.allocated = [0] * devices
        self.reserved = [0] * devices
        self.observers = []
        self.initialized = False

    def record(self, call, device):
        with self.lock:
            self.calls.append((call, device, threading.current_thread().name))

    def _device(self, device):
        if device is None:
            return getattr(self.local, "device", 0)
        if not 0 <= int(device) < self.n:
            raise RuntimeError("Invalid device argument")
        return int(device)

    def _context(self, device):
        self.initialized = True
        self.contexts.add(device)

    # torch.cuda
    def is_initialized(self):
        return self.initialized

    def device_count(self):
        return self.n

    def current_device(self):
        d = getattr(self.local, "device", 0)
        self.record("current_device", d)
        return d

    def set_device(self, device):
        d = self._device(device)
        self.record("set_device", d)
        self.local.device = d
        self._context(d)

    def mem_get_info(self, device=None):
        d = self._device(device)
        self.record("mem_get_info", d)
        self._context(d)  # torch makes d current for the call: CUDA creates its context
        return self.capacity - self.reserved[d], self.capacity

    def get_device_properties(self, device=None):
        d = self._device(device)
        self.record("get_device_properties", d)
        return _Props(d, self.capacity)

    def get_allocator_backend(self):
        return self.backend

    def nested_stats(self, device):
        d = self._device(device)
        self.record("memory_stats", d)
        asynchronous = self.backend == "cudaMallocAsync"

        def stat(current, peak=None, ever=None):
            ever = current if ever is None else ever
            return {"current": current, "peak": current if peak is None else peak,
                    "allocated": 0 if asynchronous else ever, "freed": 0}

        def arr(current):
            return {"all": stat(current), "small_pool": stat(0), "large_pool": stat(0 if asynchronous else current)}

        segments = 0 if asynchronous or not self.reserved[d] else 1
        return {
            "num_alloc_retries": 0, "num_ooms": 0, "max_split_size": -1,
            "num_device_alloc": 0 if asynchronous else segments, "num_device_free": 0,
            "allocation": arr(0 if asynchronous else segments), "segment": arr(segments),
            "active": arr(0 if asynchronous else segments), "inactive_split": arr(0),
            "allocated_bytes": arr(self.allocated[d]), "reserved_bytes": arr(self.reserved[d]),
            "active_bytes": arr(self.allocated[d]), "inactive_split_bytes": arr(0),
            "requested_bytes": arr(0 if asynchronous else self.allocated[d]),
        }

    def memory_stats(self, device=None):
        flat = {}

        def walk(prefix, v):
            for k, x in v.items():
                key = prefix + "." + k if prefix else k
                if isinstance(x, dict):
                    walk(key, x)
                else:
                    flat[key] = x

        walk("", self.nested_stats(device))
        return flat

    def memory_reserved(self, device=None):
        return self.reserved[self._device(device)]

    def empty_cache(self):
        self.record("empty_cache", None)
        for d in range(self.n):
            self.reserved[d] = self.allocated[d]

    # torch._C
    def has_primary_context(self, device):
        d = self._device(device)
        self.record("has_primary_context", d)
        return d in self.contexts

    def attach_observer(self, fn):
        if self.backend == "cudaMallocAsync":
            raise RuntimeError("cudaMallocAsync does not yet support attachOutOfMemoryObserver. "
                               "If you need it, please file an issue describing your use case.")
        self.observers.append(fn)

    def record_history(self, **kw):
        if self.backend == "cudaMallocAsync":
            raise RuntimeError("cudaMallocAsync does not yet support recordHistory. "
                               "If you need it, please file an issue describing your use case.")

    def snapshot(self):
        self.record("snapshot", None)
        if self.backend == "cudaMallocAsync":
            raise RuntimeError("Calling snapshot with backend:cudaMallocAsync is not meaningful.")
        return {"segments": [{"device": d, "address": (d + 1) << 40, "total_size": self.reserved[d],
                              "allocated_size": self.allocated[d], "segment_type": "large",
                              "blocks": [{"size": self.allocated[d], "requested_size": self.allocated[d],
                                          "state": "active_allocated"}]}
                             for d in range(self.n) if self.reserved[d]],
                "device_traces": [[] for _ in range(self.n)]}

    # The program's allocations (what a tensor on the device would do).
    def alloc(self, nbytes, device=None):
        d = self._device(device)
        self.record("alloc", d)
        self._context(d)
        if self.reserved[d] + nbytes > self.capacity:
            free = self.capacity - self.reserved[d]
            for fn in self.observers:
                fn(d, nbytes, self.capacity, free)
            raise OutOfMemoryError(self.oom_text(d, nbytes, free))
        self.allocated[d] += nbytes
        self.reserved[d] += nbytes

    def oom_text(self, d, nbytes, free):
        if self.backend == "cudaMallocAsync":
            return ("Allocation on device %d would exceed allowed memory. (out of memory)\n"
                    "Currently allocated     : %.2f GiB\nRequested               : %.2f GiB\n"
                    "Device limit            : %.2f GiB\nFree (according to CUDA): %.2f GiB\n"
                    % (d, self.allocated[d] / GIB, nbytes / GIB, self.capacity / GIB, free / GIB))
        return ("CUDA out of memory. Tried to allocate %.2f GiB. GPU %d has a total capacity of %.2f GiB "
                "of which %.2f GiB is free. Of the allocated memory %.2f GiB is allocated by PyTorch."
                % (nbytes / GIB, d, self.capacity / GIB, free / GIB, self.allocated[d] / GIB))

    def report(self):
        return {"calls": self.calls, "contexts": sorted(self.contexts)}


def install(devices=4, capacity=8 * GIB, backend="native", primary_context=True):
    """Puts the fake in sys.modules["torch"]; returns its FakeCuda."""
    fake = FakeCuda(devices, capacity, backend, primary_context)
    torch = types.ModuleType("torch")
    torch.__version__ = "2.11.0+fake"
    torch.version = types.SimpleNamespace(cuda="12.8")
    torch.OutOfMemoryError = OutOfMemoryError
    empty_cache = fake.empty_cache  # one object, as torch.cuda.empty_cache is torch.cuda.memory's
    memory = types.SimpleNamespace(_snapshot=fake.snapshot, _record_memory_history=fake.record_history,
                                   empty_cache=empty_cache)
    cuda = types.SimpleNamespace(
        is_initialized=fake.is_initialized, device_count=fake.device_count, current_device=fake.current_device,
        set_device=fake.set_device, mem_get_info=fake.mem_get_info, get_device_properties=fake.get_device_properties,
        get_allocator_backend=fake.get_allocator_backend, memory_stats=fake.memory_stats,
        memory_reserved=fake.memory_reserved, empty_cache=empty_cache, memory=memory, alloc=fake.alloc)
    c = types.SimpleNamespace(_cuda_memoryStats=fake.nested_stats,
                              _cuda_attach_out_of_memory_observer=fake.attach_observer)
    if primary_context:
        c._cuda_hasPrimaryContext = fake.has_primary_context
    torch.cuda, torch._C = cuda, c
    sys.modules["torch"] = torch
    return fake
