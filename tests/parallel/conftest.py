import pytest


@pytest.fixture(scope="session")
def matrix(tmp_path_factory):
    """``matrix(name)``: each rank's output of the ``_matrix.py`` launch ``name``, launched at
    most once per session (after the launches whose checkpoints it loads); a failed launch
    fails every test that reads it, without launching again."""
    from ._launch import run
    from ._matrix import LAUNCHES, worker

    root, done = str(tmp_path_factory.mktemp("matrix")), {}

    def get(name):
        if name not in done:
            world_size, needs, _, _ = LAUNCHES[name]
            try:
                for need in needs:
                    get(need)
                done[name] = run(worker, world_size, root, name, timeout=900, pg_timeout=600)
            except Exception as e:  # WorkerError: every rank's traceback
                done[name] = e
        if isinstance(done[name], BaseException):
            raise done[name]
        return done[name]
    return get
