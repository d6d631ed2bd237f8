"""zensync's test suite. Every folder under tests/ is a package, so modules of the same name in different
folders (``unit/kernels/test_cpu.py``, ``property/kernels/test_cpu.py``) do not collide, and shared helpers
import by their full name (``tests.strategies``, ``tests.distributed._launch``)."""
