"""The haproxy a stopped `farm serve` leaves behind is ended by node: real haproxy processes, two nodes' configs under
one base folder, as Serve's HAProxy manager lays them out (/tmp/haproxy-serve/<node id>/haproxy.cfg). `farm serve`'s
own stop ends one: tests/e2e/test_farm_commands.py."""

from rollout_farm.services.serving.haproxy_orphans import config_folder, end_node_haproxies, node_haproxies
from tests.haproxies import listening, stand_in


def test_only_the_stopped_nodes_haproxy_is_ended_and_its_port_freed(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", str(tmp_path / "haproxy-serve" / "haproxy.cfg"))
    stopped, stopped_port = stand_in(config_folder("node-a") / "haproxy.cfg")
    other, other_port = stand_in(config_folder("node-b") / "haproxy.cfg")
    try:
        assert [p.pid for p in node_haproxies("node-a")] == [stopped.pid]
        assert node_haproxies("node-c") == []  # a node with no haproxy: nothing of the others' is taken for it
        assert end_node_haproxies("node-a") == [stopped.pid]
        assert stopped.wait(timeout=30) is not None and not listening(stopped_port)
        assert other.poll() is None and listening(other_port)  # another service's haproxy keeps serving
        assert end_node_haproxies("node-a") == []
    finally:
        for proc in (stopped, other):
            proc.kill()
            proc.wait()
