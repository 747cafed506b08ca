"""What the CPU pool check counts as available memory: MemAvailable, or a container's cgroup room
when that is less; a cgroup without a limit ("max") does not count."""

from dsv4ray.worker import pool_sizing


def _files(tmp_path, monkeypatch, available_kb: int, limit: str, usage: int) -> None:
    (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kb} kB\n")
    (tmp_path / "max").write_text(limit + "\n")
    (tmp_path / "current").write_text(f"{usage}\n")
    monkeypatch.setattr(pool_sizing, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(pool_sizing, "CGROUP_FILES",
                        ((str(tmp_path / "max"), str(tmp_path / "current")),))  # fmt: skip


def test_a_containers_limit_below_the_machines_memory_wins(tmp_path, monkeypatch):
    _files(tmp_path, monkeypatch, available_kb=8 * 2**20, limit=str(3 * 2**30), usage=2**30)
    assert pool_sizing.available_host_memory() == 2 * 2**30


def test_a_cgroup_without_a_limit_leaves_the_machines_memory(tmp_path, monkeypatch):
    _files(tmp_path, monkeypatch, available_kb=8 * 2**20, limit="max", usage=2**30)
    assert pool_sizing.available_host_memory() == 8 * 2**30
