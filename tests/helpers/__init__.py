"""Code the tests share: worker entry points (importable by module name, as launched ranks need), the jobs
several tests read, process helpers and the docs' worked example. No test module imports another."""
