"""Discovery on by default: nodes given nothing but a keyring find each other on 127.0.0.1.

The suite runs with IRISMESH_DISCOVERY=0 (tests/conftest.py) so that nodes of different tests
never meet; these tests turn it back on, or check how the settings combine without starting a
node (no socket opens before `start`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import irismesh
from irismesh import _env
from irismesh._cli.config import check_interface


@pytest.fixture
def discovery_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IRISMESH_DISCOVERY")


@pytest.mark.usefixtures("discovery_on")
def test_nodes_with_no_discovery_arguments_find_each_other_on_loopback(
    keys: irismesh.Keyring,
) -> None:
    async def main() -> bytes:
        async with irismesh.Node("echo", keyring=keys) as member:
            member.on_request(lambda payload: b"echo:" + payload)
            async with irismesh.Node(keyring=keys) as client:
                assert client.endpoint.startswith("tcp://127.0.0.1:")
                await client.wait_for_members("echo", timeout=10)
                return await client.request("echo", b"hi", timeout=5)

    assert asyncio.run(main()) == b"echo:hi"


@pytest.mark.usefixtures("discovery_on")
def test_a_node_of_another_mesh_is_not_found(keys: irismesh.Keyring) -> None:
    async def main() -> None:
        other = irismesh.Keyring.generate()
        async with irismesh.Node("echo", keyring=other), irismesh.Node(keyring=keys) as client:
            with pytest.raises(irismesh.MembershipTimeout):
                await client.wait_for_members("echo", timeout=0.6)
            assert client.peers() == []

    asyncio.run(main())


def test_default_discovery_is_a_survey_on_loopback_and_each_switch_turns_it_off(
    keys: irismesh.Keyring, monkeypatch: pytest.MonkeyPatch
) -> None:
    def survey(**kwargs: object) -> irismesh.SurveyConfig | None:
        return irismesh.Node(keyring=keys, **kwargs)._survey_config  # type: ignore[arg-type]

    monkeypatch.delenv("IRISMESH_DISCOVERY")
    on = survey()
    assert on is not None
    assert on.interface == "127.0.0.1"
    assert on.realm  # a tag under the '*' key: other meshes stay apart
    assert survey(discovery=False) is None
    assert survey(survey=False) is None  # the only default method, turned off
    assert irismesh.Node(keyring=keys)._mdns_config is None  # mDNS only when asked
    monkeypatch.setenv("IRISMESH_DISCOVERY", "off")
    assert survey() is None
    assert survey(discovery=True) is not None
    assert survey(survey=True) is not None  # asked for by name: the variable does not matter
    with pytest.raises(irismesh.ConfigurationError, match="discovery=False, yet survey="):
        survey(discovery=False, survey=True)
    monkeypatch.setenv("IRISMESH_DISCOVERY", "sometimes")
    with pytest.raises(irismesh.ConfigurationError, match="IRISMESH_DISCOVERY='sometimes'"):
        survey()


def test_interface_moves_discovery_and_the_listening_address(
    keys: irismesh.Keyring, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("IRISMESH_DISCOVERY")
    # 127.0.0.2 stands for a LAN address here; nothing is started, nothing is sent.
    node = irismesh.Node(keyring=keys, interface="127.0.0.2", mdns=True)
    assert node._bind == "tcp://127.0.0.2:0"
    assert node._survey_config is not None
    assert node._survey_config.interface == "127.0.0.2"
    assert node._mdns_config is not None
    assert node._mdns_config.interfaces == ("127.0.0.2",)
    monkeypatch.setenv("IRISMESH_INTERFACE", "127.0.0.3")
    node = irismesh.Node(keyring=keys, bind="tcp://127.0.0.1:0")
    assert node._bind == "tcp://127.0.0.1:0"  # an explicit bind stays
    assert node._survey_config is not None
    assert node._survey_config.interface == "127.0.0.3"
    # Addresses that are no one interface's are refused from the environment alone, with no
    # node made: nothing could bind or send on them by mistake.
    for wrong in ("0.0.0.0", "224.0.0.1", "not-an-address"):
        with pytest.raises(irismesh.ConfigurationError, match=f"IRISMESH_INTERFACE={wrong!r}"):
            _env.interface({"IRISMESH_INTERFACE": wrong})
        with pytest.raises(irismesh.ConfigurationError, match="bad interface"):
            check_interface(wrong)


def test_seeds_from_the_environment_are_added(
    keys: irismesh.Keyring, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IRISMESH_SEEDS", "tcp://127.0.0.1:7401, tcp://127.0.0.1:7402")
    node = irismesh.Node(keyring=keys, seeds=["tcp://127.0.0.1:7402", "tcp://127.0.0.1:7400"])
    assert node._seeds == ["tcp://127.0.0.1:7402", "tcp://127.0.0.1:7400", "tcp://127.0.0.1:7401"]
    monkeypatch.setenv("IRISMESH_SEEDS", "127.0.0.1:7401")
    with pytest.raises(irismesh.ConfigurationError, match="bad endpoint"):
        irismesh.Node(keyring=keys)


def test_a_node_without_a_keyring_takes_the_default_one(
    keys: irismesh.Keyring, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("IRISMESH_KEYFILE", raising=False)
    monkeypatch.delenv("IRISMESH_KEYS", raising=False)
    with pytest.raises(irismesh.ConfigurationError, match="run `mesh keygen`"):
        irismesh.Node()
    path = _env.default_keyfile()
    assert path == tmp_path / "irismesh" / "mesh.keys"
    path.parent.mkdir()
    keys.save(path)
    assert irismesh.Node().keyring.to_text() == keys.to_text()


@pytest.mark.usefixtures("discovery_on")
def test_a_default_survey_that_cannot_start_is_a_warning_one_asked_for_an_error(
    keys: irismesh.Keyring, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def refuse(self: object) -> None:
        raise irismesh.ConfigurationError("survey discovery cannot listen: port held")

    monkeypatch.setattr(irismesh.discovery.survey.SurveyDiscovery, "start", refuse)

    async def main() -> None:
        async with irismesh.Node("echo", keyring=keys) as node:
            assert node.endpoint.startswith("tcp://127.0.0.1:")
        with pytest.raises(irismesh.ConfigurationError, match="port held"):
            await irismesh.Node(keyring=keys, survey=True).start()

    asyncio.run(main())
    assert "default discovery is off for this node: survey discovery cannot" in caplog.text
