from dataclasses import replace

from hf_gpu_train.hardware.crosscheck import compare, parse_query_csv, parse_topo_matrix

QUERY = """index, name, uuid, pci.bus_id, memory.total [MiB], compute_cap
0, NVIDIA A100-SXM4-40GB, GPU-a100-sxm-40-00-0000-0000-000000000007, 00000000:07:00.0, 40960 MiB, 8.0
1, NVIDIA A100-SXM4-40GB, GPU-a100-sxm-40-01-0000-0000-00000000000f, 00000000:0F:00.0, 40960 MiB, 8.0
"""

TOPO = """\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV12\tPXB\t0-31\t0\t\tN/A
GPU1\tNV12\t X \tPXB\t0-31\t0\t\tN/A
NIC0\tPXB\tPXB\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
"""


def test_agreeing_outputs_give_no_mismatch(machine):
    rows, topo = parse_query_csv(QUERY), parse_topo_matrix(TOPO)
    assert rows[1]["pci.bus_id"] == "00000000:0F:00.0" and topo == {(0, 1): "NV12"}
    assert compare(machine("2x-a100-one-busy"), rows, topo) == []


def test_every_difference_is_named(machine):
    box = machine("2x-a100-one-busy")
    wrong = replace(box, gpus=(replace(box.gpus[0], name="NVIDIA A100-PCIE-40GB"), box.gpus[1]),
                    pairs=(replace(box.pairs[0], nvlinks=0),))
    found = compare(wrong, parse_query_csv(QUERY), parse_topo_matrix(TOPO))
    assert any("GPU0 name" in m for m in found)
    assert "topology GPU0-GPU1: nvidia-smi NV12, hf-gpu-train PXB" in found
    assert compare(replace(box, gpus=box.gpus[:1]), parse_query_csv(QUERY), {})[0].startswith("GPU count")
