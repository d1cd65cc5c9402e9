"""Issue 37: what the quality benchmark scores at the end, and what its quick profile's table says it shows.

The quick profile ends SemiFL within noise of server-only because its silos train too little (PROFILE_NOTES in
bench/quality/run.py), not because the round loop scores a hub-only model: these tests hold that down."""

from __future__ import annotations

import copy

import torch
from torch import nn

from silo_core.algorithms.base import HubAlgorithm, HubData, HubState, SiloAlgorithm, SiloData
from silo_core.algorithms.semifl import SemiFLHub, SemiFLOptions, SemiFLSilo
from silo_core.algorithms.server_only import ServerOnlyHub, ServerOnlyOptions
from silo_core.models import ModelSpec
from silo_core.rounds import RoundRecord
from silo_sim.inprocess import run_inprocess
from tests.bench import load_script

SPEC = ModelSpec(options={"width": 4})
ROUNDS = 2
# Every image passes tau 0, so every silo trains in every round, the last one included.
OPTIONS = {"tau": 0.0, "hub_epochs": 2, "local_epochs": 2, "silo_batch_size": 8, "hub_batch_size": 10}


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def images(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g)


def run(hub: HubAlgorithm, silo: SiloAlgorithm | None) -> tuple[dict[int, HubState], list[RoundRecord]]:
    """The benchmark's in-process round loop: each round's scored state (copied) and the history."""
    scored: dict[int, HubState] = {}

    def evaluate(state: HubState) -> dict[str, float]:
        scored[state.round] = copy.deepcopy(state)
        return {"accuracy": 0.0, "loss": 0.0}

    silos = [SiloData(images=images(32, 10 + i), true_labels=torch.arange(32) % 10, silo_id=f"silo-{i:03d}")
             for i in range(3)]
    final, history = run_inprocess(hub, silo, silos, ROUNDS, 1.0, 0, evaluate)
    assert final.round == ROUNDS
    return scored, history


def test_the_final_scored_model_is_the_federated_one_with_the_last_rounds_silo_work():
    data = HubData(images(20, 0), torch.arange(20) % 10)
    options = SemiFLOptions(**OPTIONS)
    hub = SemiFLHub(options, SPEC, data, torch.device("cpu"), seed=0, total_rounds=ROUNDS)
    scored, history = run(hub, SemiFLSilo(options, SPEC, torch.device("cpu")))
    assert history[-1].silos_contributed == 3
    federated = flat(hub.served_model(scored[ROUNDS]))
    # What the hub's own fine-tune alone makes of the model it sent in the last round (same batches: they are
    # seeded by the round), and what server-only ends with.
    alone, _ = hub.finish_round(scored[ROUNDS - 1], {}, {})
    hub_alone = flat(hub.served_model(alone))
    server_only = ServerOnlyHub(ServerOnlyOptions(**OPTIONS), SPEC, data, torch.device("cpu"), seed=0,
                                total_rounds=ROUNDS)
    floor, _ = run(server_only, None)
    floor_model = flat(server_only.served_model(floor[ROUNDS]))
    size = float(hub_alone.norm())
    assert float((federated - hub_alone).norm()) > 1e-2 * size
    assert float((federated - floor_model).norm()) > 1e-2 * size


def test_the_quick_and_tiny_tables_say_they_do_not_rank_methods():
    quality = load_script("bench/quality/run.py", "quality_run")
    machine = {"platform": "test", "cpu_count": 2, "cuda": False}
    cells = [{"method": m, "partition": "iid", "seed": 0, "final_accuracy": 0.72, "model": "small_cnn"}
             for m in ("server-only", "semifl")]
    for profile in ("tiny", "quick"):
        header = quality.markdown_table(cells, profile, machine).split("| method |")[0]
        assert "does not rank methods" in header
    assert "does not rank" not in quality.markdown_table(cells, "full", machine)


def semifl_cells_ran_on(*machines: dict) -> list[dict]:
    """One IID SemiFL cell a seed, each with the machine record it ran on."""
    return [{"method": "semifl", "partition": "iid", "seed": seed, "final_accuracy": 0.8, "model": "small_cnn",
             "machine": info} for seed, info in enumerate(machines)]


def test_the_table_names_each_processor_its_cells_ran_on():
    quality = load_script("bench/quality/run.py", "quality_run")
    here = quality.machine()
    assert here["cpu"] and here["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    zen = {"platform": "test", "cpu_count": 2, "cuda": False, "cpu": "AMD EPYC", "cpu_capability": "AVX2"}
    other = {**zen, "cpu": "Intel Xeon", "cpu_capability": "AVX512"}
    cells = semifl_cells_ran_on(zen, zen, other, {"platform": "older run"})

    header = quality.markdown_table(cells, "full", zen).split("| method |")[0]
    assert "2 CPUs (AMD EPYC, AVX2), no GPU." in header
    assert ("more than one processor, and a cell's figures move with it (bench/README.md): AMD EPYC, AVX2, 2 cells; "
            "Intel Xeon, AVX512, 1 cell; not recorded, 1 cell.") in header
    # One recorded processor beside cells from before it was recorded: they may differ, and the line says so.
    header = quality.markdown_table([cells[0], cells[3]], "full", zen).split("| method |")[0]
    assert "more than one processor" not in header
    assert ("Some cells ran before the runner recorded the processor, perhaps on another one, and a cell's figures "
            "move with it (bench/README.md): AMD EPYC, AVX2, 1 cell; not recorded, 1 cell.") in header
    # Every cell on one recorded processor: the machine line says it all.
    header = quality.markdown_table(cells[:2], "full", zen).split("| method |")[0]
    assert "more than one processor" not in header and "before the runner recorded" not in header


def test_the_table_names_each_thread_count_its_cells_ran_at():
    # At 1 torch thread against 2 the same cell ends up to 0.6 points apart, so a folder resumed with another
    # --threads must say that its cells mix the two.
    quality = load_script("bench/quality/run.py", "quality_run")
    assert quality.machine()["torch_threads"] == torch.get_num_threads()
    one = {"platform": "test", "cpu_count": 2, "cuda": False, "cpu": "AMD EPYC", "cpu_capability": "AVX2",
           "torch_threads": 1}
    two = {**one, "torch_threads": 2}
    cells = semifl_cells_ran_on(two, one, two, {"platform": "older run"})

    header = quality.markdown_table(cells, "full", two).split("| method |")[0]
    assert "2 CPUs (AMD EPYC, AVX2), no GPU, 2 torch threads a cell." in header
    assert ("more than one thread count, and a cell's figures move with it (bench/README.md): 2 threads, 2 cells; "
            "1 thread, 1 cell; not recorded, 1 cell.") in header
    header = quality.markdown_table([cells[0], cells[2], cells[3]], "full", two).split("| method |")[0]
    assert "more than one thread count" not in header
    assert ("Some cells ran before the runner recorded the thread count, perhaps at another, and a cell's figures "
            "move with it (bench/README.md): 2 threads, 2 cells; not recorded, 1 cell.") in header
    header = quality.markdown_table([cells[0], cells[2]], "full", two).split("| method |")[0]
    assert "thread count" not in header
    # A run record from before the count was kept has no thread clause.
    old = {k: v for k, v in one.items() if k != "torch_threads"}
    assert "2 CPUs (AMD EPYC, AVX2), no GPU." in quality.markdown_table(cells[:1], "full", old)
