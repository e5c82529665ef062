"""`rdt-jax doctor`: runs end to end on this host, and each of its decisions
on crafted and recorded inputs (UCX logs from a CPU run here and from a GPU
run in docs/benchmarks/gpu/2026-11-27/).

The end-to-end runs are real: two NIXL agents in two processes READ from
each other, in the environment each test sets (UCX_TLS=tcp makes UCX emulate
the host READ over TCP; UCX_PROTO_EMULATION_ENABLE=n then makes it fail).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import time

import pytest

from _helpers import clean_env
from rdt_jax import _doctor, _ray
from rdt_jax.__main__ import main
from rdt_jax._doctor import Finding, ReadPath, ReadResult, installed
from rdt_jax.transports.nixl import ucx

REPO = pathlib.Path(__file__).parent.parent
PROBE = REPO / "docs" / "benchmarks" / "gpu" / "2026-11-27"
MIB16 = 16 << 20

#: The initiator's tables from a loopback READ on this CPU host (UCX 1.23,
#: nixl-cu12 1.5.1), defaults, then with UCX_TLS=tcp.
HOST_LOG = """\
[1795803245.687521] [vm:5036 :0]     ucp_context.c:2753 UCX  INFO  Version 1.23.0 (loaded from /x/libucp.so.0.0.0)
[1795803245.987890] [vm:5036 :0]   +-------+------------+--------------------+------------+
[1795803245.987890] [vm:5036 :0]   | doctor-initiator intra-node cfg#1                    |
[1795803245.987890] [vm:5036 :0]   | active message by ucp_am_send*(egr) from host memory |
[1795803245.987890] [vm:5036 :0]   +-------+------------+--------------------+------------+
[1795803245.987890] [vm:5036 :0]   | Count |   Range    |    Description     |   Config   |
[1795803245.987890] [vm:5036 :0]   +-------+------------+--------------------+------------+
[1795803245.987890] [vm:5036 :0]   |     0 |          0 | short              | tcp/lo     |
[1795803245.987890] [vm:5036 :0]   |     3 |   1..16515 | zero-copy          | tcp/lo     |
[1795803245.987890] [vm:5036 :0]   |     0 | 16516..inf | multi-frag copy-in | tcp/lo     |
[1795803245.987890] [vm:5036 :0]   +-------+------------+--------------------+------------+
[1795803245.987920] [vm:5036 :0]   +-------+--------+-------------+-----------------------------------+
[1795803245.987920] [vm:5036 :0]   | doctor-initiator intra-node cfg#1                                |
[1795803245.987920] [vm:5036 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795803245.987920] [vm:5036 :0]   +-------+--------+-------------+-----------------------------------+
[1795803245.987920] [vm:5036 :0]   | Count | Range  | Description |              Config               |
[1795803245.987920] [vm:5036 :0]   +-------+--------+-------------+-----------------------------------+
[1795803245.987920] [vm:5036 :0]   |     3 | 0..inf | zero-copy   | cma/memory                        |
[1795803245.987920] [vm:5036 :0]   +-------+--------+-------------+-----------------------------------+
"""
HOST_TCP_LOG = """\
[1795803363.752120] [vm:6809 :0]   +-------+--------+--------------------+----------------------------+
[1795803363.752120] [vm:6809 :0]   | doctor-initiator intra-node cfg#1                                |
[1795803363.752120] [vm:6809 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795803363.752120] [vm:6809 :0]   +-------+--------+--------------------+----------------------------+
[1795803363.752120] [vm:6809 :0]   | Count | Range  |    Description     |           Config           |
[1795803363.752120] [vm:6809 :0]   +-------+--------+--------------------+----------------------------+
[1795803363.752120] [vm:6809 :0]   |     3 | 0..inf | software emulation | tcp/lo                     |
[1795803363.752120] [vm:6809 :0]   +-------+--------+--------------------+----------------------------+
"""


def doctor_env(**extra: str) -> dict[str, str]:
  """The environment a user would run the command in: none of the UCX,
  rdt_jax or XLA settings the test session may have set, plus `extra`."""
  env = {k: v for k, v in clean_env().items() if not k.startswith(("UCX_", "RDT_JAX_", "XLA_"))}
  return {**env, **extra}


def run_doctor(*args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "rdt_jax", "doctor", *args],
      capture_output=True, text=True, timeout=timeout, env=doctor_env(**env), cwd=REPO,
  )


def run_doctor_watching(*args: str, timeout: float = 180) -> tuple[subprocess.CompletedProcess, bool]:
  """Runs the command as `run_doctor` does, reading its stderr as it comes:
  (the finished process, whether the loopback check's name had come out while
  the command was still running, before its result)."""
  import threading

  proc = subprocess.Popen([sys.executable, "-m", "rdt_jax", "doctor", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=doctor_env(), cwd=REPO)
  stdout: list[bytes] = []
  reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()))  # type: ignore[union-attr]
  reader.start()
  started = f"[4/5] {_doctor.CHECKS[3]} ... ".encode()
  stderr, seen_running = b"", False
  deadline = time.monotonic() + timeout
  while chunk := proc.stderr.read1(4096):  # type: ignore[union-attr]
    stderr += chunk
    if not seen_running and stderr.endswith(started):
      seen_running = proc.poll() is None
    assert time.monotonic() < deadline, stderr.decode()
  proc.wait(timeout=max(1.0, deadline - time.monotonic()))
  reader.join()
  return subprocess.CompletedProcess(proc.args, proc.returncode, stdout[0].decode(), stderr.decode()), seen_running


def progress_lines(stderr: str) -> list[tuple[str, str]]:
  """(check name, result) of each progress line the command wrote to stderr, in order."""
  return re.findall(r"^\[\d/5\] (.+?) \.\.\. (.+) \(\d+\.\d s\)$", stderr, re.M)


def finding(report: dict, what_starts: str) -> dict:
  """The one finding of `report` whose text starts with `what_starts`."""
  found = [f for f in report["findings"] if f["what"].startswith(what_starts)]
  assert len(found) == 1, (what_starts, report["findings"])
  return found[0]


# ---- end to end, on this host


@pytest.mark.slow  # runs the command's NIXL loopback in a subprocess: tens of seconds
def test_doctor_passes_on_this_host_and_finds_the_host_read_path():
  proc, seen_running = run_doctor_watching("--json")
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  report = json.loads(proc.stdout)  # nothing but the report on stdout: the children's output is kept apart
  # Progress on stderr: each check's name as it starts (out at once, while the command runs), then its result.
  assert seen_running, proc.stderr
  lines = progress_lines(proc.stderr)
  assert [name for name, _ in lines] == list(_doctor.CHECKS), proc.stderr
  assert lines[0][1].startswith(f"ray {report['versions']['ray']['version']}, jax "), lines
  assert [result for _, result in lines[1:]] == ["ok, 0 visible", "ok", "ok", "ok"], lines
  assert report["schema"] == "rdt-jax-doctor/1" and report["exit_status"] == 0
  assert {f["severity"] for f in report["findings"]} <= {"ok", "warn"}
  assert all(f["what"] for f in report["findings"])
  versions = report["versions"]
  assert {"python", "ray", "jax", "numpy", "torch", "cupy", "nixl"} <= set(versions)
  assert versions["nixl"]["module"].startswith(("nixl_cu12.", "nixl_cu13."))
  assert versions["jax"]["backend"] == "cpu"
  assert report["ray"]["tested_range"] == _ray.version.SUPPORTED_RAY and report["ray"]["tested"] is True
  assert "jax_nixl" in report["transports"]["rdt_jax"]
  assert report["gpus"]["count"] == 0
  host = report["ucx"]["reads"]["host"]
  assert host["state"] == "DONE" and host["bytes_ok"] is True and host["gbps"] > 0
  assert len(host["seconds"]) == 5
  path = host["path"]
  assert path is not None, report["ucx"]  # UCX's protocol table was found and parsed
  assert path["protocol"] and path["transport"] and path["count"] >= 5
  assert "emulation" not in path["protocol"] and not path["transport"].startswith("tcp")
  assert report["ucx"]["version"]
  assert "cuda" not in report["ucx"]["reads"]  # no GPU here: no device READ
  assert report["ucx"]["node_local"]["state"] == "ok"
  assert finding(report, "NIXL READ of host memory")["severity"] == "ok"


@pytest.mark.slow  # runs the command's NIXL loopback in a subprocess: tens of seconds
def test_host_memory_only_over_tcp_is_a_fail():
  # UCX_TLS=tcp: UCX emulates the READ over TCP; RDT_JAX_NIXL_CMA=0: no direct read either.
  proc = run_doctor("--json", UCX_TLS="tcp", RDT_JAX_NIXL_CMA="0")
  assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
  report = json.loads(proc.stdout)
  path = report["ucx"]["reads"]["host"]["path"]
  assert "emulation" in path["protocol"] and path["transport"].startswith("tcp")
  host = finding(report, "NIXL READ of host memory")
  assert host["severity"] == "fail" and "only through TCP" in host["why"] and "UCX_TLS" in host["fix"]
  assert finding(report, "node-local host read")["severity"] == "warn"
  assert report["ucx"]["env"]["UCX_TLS"] == "tcp"


@pytest.mark.slow  # runs the command's NIXL loopback in a subprocess: tens of seconds
def test_a_failing_loopback_is_a_fail_with_ucx_reason():
  # No emulation allowed and no transport that can READ: UCX refuses the READ.
  start = time.monotonic()
  proc = run_doctor("--json", "--timeout", "60", UCX_TLS="tcp", UCX_PROTO_EMULATION_ENABLE="n")
  assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
  assert time.monotonic() - start < 90
  report = json.loads(proc.stdout)
  host = finding(report, "NIXL READ of host memory")
  assert host["severity"] == "fail" and "failed in the loopback" in host["what"]
  assert "No zero-copy protocol found for get into host from host" in host["why"]


@pytest.mark.slow  # runs the command's NIXL loopback in a subprocess: tens of seconds
def test_without_nixl_it_warns_and_exits_0():
  proc = run_doctor(PYTHONPATH=str(REPO / "tests" / "_no_nixl"))  # NIXL made unimportable, as in test_nixl
  assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
  text = proc.stdout
  assert text.startswith("rdt-jax doctor\n\nVersions\n"), text  # the report alone: progress goes to stderr
  assert [name for name, _ in progress_lines(proc.stderr)] == list(_doctor.CHECKS), proc.stderr
  assert progress_lines(proc.stderr)[2][1] == "warn", proc.stderr  # NIXL missing: jax_nixl not registered
  assert "warn  NIXL is not installed: the jax_nixl transport is unavailable" in text
  assert "NIXL READ of host memory: not checked" in text
  assert "jax_nixl" not in text.split("Transports", 1)[1].split("\n")[1]  # the rdt_jax line
  assert text.rstrip().endswith("0 fail, 1 warn: exit status 0")


def test_command_line_lists_doctor(capsys):
  with pytest.raises(SystemExit) as exit_:
    main(["doctor", "--help"])
  assert exit_.value.code == 0
  assert "--jax-processes-per-gpu" in capsys.readouterr().out


def test_loopback_that_runs_out_of_time_is_reported_and_leaves_nothing_running():
  import multiprocessing

  start = time.monotonic()
  loop = _doctor.run_loopback({}, installed._nixl_version()["module"], ["host"], 1 << 20, (0, 0), timeout_s=0.2)
  assert time.monotonic() - start < 10
  assert loop.error and "did not finish within 0.2 s" in loop.error
  assert "did not finish" in loop.reads["host"].state
  assert multiprocessing.active_children() == []
  verdict = _doctor.judge_host_read(loop.reads["host"], None, False, [])
  assert verdict.severity == "fail"


def test_progress_writes_a_check_s_name_before_it_runs_then_its_worst_finding():
  import io

  stream = io.StringIO()
  progress = _doctor.Progress(3, stream)
  with progress.check("first") as step:
    assert stream.getvalue() == "[1/3] first ... "
    step.findings = [Finding("ok", "a"), Finding("warn", "b"), Finding("warn", "c")]
  assert re.fullmatch(r"\[1/3\] first \.\.\. 2 warn \(\d\.\d s\)\n", stream.getvalue())
  with progress.check("second") as step:
    step.findings, step.note = [Finding("ok", "a"), Finding("fail", "b")], "2 visible"
  with progress.check("third") as step:
    step.note = "ray 2.60.0"
  lines = stream.getvalue().splitlines()
  assert re.fullmatch(r"\[2/3\] second \.\.\. fail, 2 visible \(\d\.\d s\)", lines[1])
  assert re.fullmatch(r"\[3/3\] third \.\.\. ray 2\.60\.0 \(\d\.\d s\)", lines[2])
  with pytest.raises(KeyError), _doctor.Progress(1, stream).check("broken"):
    raise KeyError("x")
  assert re.fullmatch(r"\[1/1\] broken \.\.\. stopped by KeyError \(\d\.\d s\)", stream.getvalue().splitlines()[-1])
  with _doctor.Progress(1, None).check("silent") as step:
    assert step.result() == "done"


# ---- UCX's protocol tables


def test_parses_the_host_read_of_a_cpu_host():
  tables = _doctor.parse_proto_tables(HOST_LOG)
  assert [t.operation for t in tables] == ["active message", "remote memory read"]
  am, read = tables
  assert am.local_memory == "host" and len(am.rows) == 3 and am.rows[1].count == 3
  assert read.context == "doctor-initiator intra-node cfg#1"
  assert (read.local_memory, read.remote_memory) == ("host", "host")
  assert _doctor.read_path(tables, "host") == ReadPath("host", "zero-copy", "cma/memory", 3)
  assert _doctor.read_path(tables, "cuda") is None
  assert _doctor.ucx_version(HOST_LOG) == "1.23.0"
  tcp = _doctor.read_path(_doctor.parse_proto_tables(HOST_TCP_LOG), "host")
  assert tcp is not None and tcp.emulated and tcp.over_tcp


def test_parses_the_gpu_probe_logs():
  default = _doctor.parse_proto_tables((PROBE / "ucx-default.502.log").read_text())
  read = _doctor.read_path(default, "cuda")
  assert read == ReadPath("cuda", "software emulation", "tcp/lo", 6)
  assert read.emulated and read.over_tcp
  write = [t for t in default if t.operation == "remote memory write"]
  assert len(write) == 1 and write[0].rows[0].config == "cuda_ipc/cuda"
  assert (write[0].local_memory, write[0].remote_memory) == ("cuda", "cuda")
  fixed = _doctor.read_path(_doctor.parse_proto_tables((PROBE / "ucx-getzcopy.628.log").read_text()), "cuda")
  assert fixed == ReadPath("cuda", "zero-copy", "cuda_ipc/cuda", 6)
  assert not fixed.emulated and not fixed.over_tcp
  # The target side logs no READ table.
  assert _doctor.read_path(_doctor.parse_proto_tables((PROBE / "ucx-default.501.log").read_text()), "cuda") is None
  assert _doctor.ucx_version((PROBE / "ucx-default.501.log").read_text()) == "1.23.0"


def test_finds_ucx_errors():
  errors = _doctor.ucx_errors((PROBE / "probe.log").read_text())
  assert errors == [
      "No zero-copy protocol found for get into cuda from cuda, 268435456 bytes. Please check for proper GPU "
      "and/or HCA support, or set UCX_PROTO_EMULATION_ENABLE=y to proceed by allowing slower software emulation."
  ]
  assert _doctor.ucx_errors(HOST_LOG) == []


def test_tables_without_count_column_and_unused_rows():
  text = (
      "| agent intra-node cfg#0 |\n| remote memory read by ucp_get*(multi) into host memory from host |\n"
      "+---+\n| Range | Description | Config |\n+---+\n| 0..8k | copy-in | posix/memory |\n"
      "| 8k..inf | zero-copy | cma/memory |\n+---+\n"
  )
  [table] = _doctor.parse_proto_tables(text)
  assert [r.count for r in table.rows] == [-1, -1]
  path = _doctor.read_path([table], "host")
  assert path == ReadPath("host", "copy-in; zero-copy", "posix/memory; cma/memory", 0)
  unused = _doctor.parse_proto_tables(HOST_LOG.replace("|     3 | 0..inf | zero-copy", "|     0 | 0..inf | zero-copy"))
  assert _doctor.read_path(unused, "host") is None


# ---- decisions


def done(memory: str, nbytes: int, seconds: list[float], allocator: str = "torch") -> ReadResult:
  return ReadResult(memory, nbytes, seconds, "DONE", True, allocator, "cuda:0 <- cuda:0")


#: The probe's 256 MiB device READs on an H200: UCX defaults, then GET zcopy on.
EMULATED = done("cuda", 256 << 20, [0.503, 0.467, 0.467, 0.467, 0.467])
CUDA_IPC = done("cuda", 256 << 20, [0.00225, 0.00023, 0.00023, 0.00023, 0.00023])


def test_emulated_device_read_is_a_fail():
  path = _doctor.read_path(_doctor.parse_proto_tables((PROBE / "ucx-default.502.log").read_text()), "cuda")
  verdict = _doctor.judge_device_read(EMULATED, path, [])
  assert verdict.severity == "fail" and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in verdict.fix
  assert "0.57 GB/s" in verdict.what


def test_cuda_ipc_device_read_is_ok():
  path = _doctor.read_path(_doctor.parse_proto_tables((PROBE / "ucx-getzcopy.628.log").read_text()), "cuda")
  verdict = _doctor.judge_device_read(CUDA_IPC, path, [])
  assert verdict.severity == "ok" and "cuda_ipc/cuda" in verdict.what


def test_slow_or_broken_device_reads_fail():
  fast = ReadPath("cuda", "zero-copy", "cuda_ipc/cuda", 5)
  slow = done("cuda", MIB16, [0.02] * 5)  # 0.84 GB/s
  assert _doctor.judge_device_read(slow, fast, []).severity == "fail"
  wrong = done("cuda", MIB16, [1e-4] * 5)
  wrong.bytes_ok = False
  assert _doctor.judge_device_read(wrong, fast, []).severity == "fail"
  failed = ReadResult("cuda", MIB16, state="nixlRemoteDisconnectError: NIXL_ERR_REMOTE_DISCONNECT")
  verdict = _doctor.judge_device_read(failed, None, ["No zero-copy protocol found for get into cuda"])
  assert verdict.severity == "fail" and "No zero-copy protocol" in verdict.why
  staged = ReadPath("cuda", "rendezvous pipeline", "cuda_copy/cuda", 5)
  assert _doctor.judge_device_read(done("cuda", MIB16, [1e-3] * 5), staged, []).severity == "warn"
  assert _doctor.judge_device_read(None, None, []).severity == "ok"  # no GPU


def test_host_read_decisions():
  ok = done("host", MIB16, [0.04, 0.004, 0.004], "numpy")
  cma = ReadPath("host", "zero-copy", "cma/memory", 3)
  tcp = ReadPath("host", "software emulation", "tcp/lo", 3)
  assert _doctor.judge_host_read(ok, cma, True, []).severity == "ok"
  assert _doctor.judge_host_read(ok, tcp, True, []).severity == "warn"  # direct reads still work
  assert _doctor.judge_host_read(ok, tcp, False, []).severity == "fail"
  assert _doctor.judge_host_read(ok, None, True, []).severity == "warn"  # protocol not logged
  wrong = done("host", MIB16, [0.004], "numpy")
  wrong.bytes_ok = False
  assert _doctor.judge_host_read(wrong, cma, True, []).severity == "fail"
  assert _doctor.judge_host_read(None, None, False, []).severity == "ok"  # NIXL not installed
  assert _doctor.judge_node_local("ok", 5.0).severity == "ok"
  assert _doctor.judge_node_local("off", None).severity == "warn"
  assert _doctor.judge_node_local("PermissionError: [Errno 1] not permitted", None).severity == "warn"


def test_get_zcopy_off_on_a_gpu_host_is_a_fail(monkeypatch):
  monkeypatch.delenv("RDT_JAX_UCX_DEFAULTS", raising=False)
  # What a jax_nixl process gets on a (simulated) host with a CUDA driver.
  env, applied = _doctor.jax_nixl_ucx_env({}, cuda=True)
  assert env == applied == ucx.DEVICE_READ_DEFAULTS
  assert _doctor.judge_device_read_settings(ucx.device_read_problem(env), gpu_count=1).severity == "ok"
  # The user turned the GET off: rdt_jax keeps it, and the doctor fails on a GPU host.
  env, applied = _doctor.jax_nixl_ucx_env({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}, cuda=True)
  assert env == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"} and applied == {}
  verdict = _doctor.judge_device_read_settings(ucx.device_read_problem(env), gpu_count=1)
  assert verdict.severity == "fail" and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n" in verdict.why
  # Without a GPU it does not apply, and is still shown.
  verdict = _doctor.judge_device_read_settings(ucx.device_read_problem(env), gpu_count=0)
  assert verdict.severity == "ok" and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n" in verdict.why
  # Defaults turned off on a GPU host: the GET stays at UCX's choice, off without NVLink.
  monkeypatch.setenv("RDT_JAX_UCX_DEFAULTS", "0")
  env, applied = _doctor.jax_nixl_ucx_env({}, cuda=True)
  assert env == applied == {}
  assert _doctor.judge_device_read_settings(ucx.device_read_problem(env), gpu_count=1).severity == "fail"


@pytest.mark.parametrize(
    ("env", "processes", "severity"),
    [
        ({}, 2, "fail"),  # 2 x 75%
        ({}, 1, "ok"),
        ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, 4, "ok"),
        ({"XLA_PYTHON_CLIENT_PREALLOCATE": "0"}, 4, "ok"),
        ({"XLA_PYTHON_CLIENT_PREALLOCATE": "no"}, 2, "fail"),  # jaxlib reads only false/False/0 as off
        ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, 2, "ok"),
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45"}, 2, "ok"),
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, 2, "fail"),  # adds up to 1: nothing left
        ({"XLA_CLIENT_MEM_FRACTION": "0.3"}, 3, "ok"),
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "half"}, 1, "fail"),
        ({"XLA_CLIENT_MEM_FRACTION": "0.3", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}, 1, "fail"),
    ],
)
def test_xla_preallocation_rule(env, processes, severity):
  verdict = _doctor.judge_xla_memory(env, gpu_count=1, processes_per_gpu=processes)
  assert verdict.severity == severity, verdict
  if severity == "fail":
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in verdict.fix and "docs/gpu.md" in verdict.fix


def test_xla_rule_names_a_fraction_that_fits():
  verdict = _doctor.judge_xla_memory({}, gpu_count=8, processes_per_gpu=2)
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 at most" in verdict.fix
  fitted = _doctor.judge_xla_memory({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45"}, gpu_count=8, processes_per_gpu=2)
  assert fitted.severity == "ok"
  assert _doctor.judge_xla_memory({}, gpu_count=0, processes_per_gpu=4).severity == "ok"  # no GPU


def test_ray_range_decisions():
  args = (_ray.version.SUPPORTED_RAY, _ray.version.ALLOW_UNTESTED_ENV)
  assert _doctor.judge_ray("2.60.0", True, False, *args).severity == "ok"
  refused = _doctor.judge_ray("2.61.0", False, False, *args)
  assert refused.severity == "fail" and f"{_ray.version.ALLOW_UNTESTED_ENV}=1" in refused.fix
  assert _doctor.judge_ray("2.61.0", False, True, *args).severity == "warn"
  assert _doctor.judge_ray(None, False, False, *args).severity == "fail"


def test_ray_check_uses_the_seams_range(monkeypatch):
  monkeypatch.delenv(_ray.version.ALLOW_UNTESTED_ENV, raising=False)
  info, verdict = _doctor.collect_ray()
  assert info["tested"] == _ray.version.ray_version_tested()
  assert verdict.severity == ("ok" if info["tested"] else "fail")
  monkeypatch.setenv(_ray.version.ALLOW_UNTESTED_ENV, "maybe")
  assert _doctor.collect_ray()[1].severity == "fail"


def test_package_decisions():
  present = {"version": "1"}
  base = {"jax": {**present, "backend": "gpu"}, "numpy": present, "torch": {**present, "cuda": "13.0"},
          "nixl": {**present, "cuda": "13"}}
  assert _doctor.judge_packages(base, gpu_count=1) == []
  no_nixl = _doctor.judge_packages({**base, "nixl": {"version": None, "error": "No module named 'nixl'"}}, 0)
  assert [f.severity for f in no_nixl] == ["warn"] and "jax_nixl" in no_nixl[0].what
  assert [f.severity for f in _doctor.judge_packages({**base, "torch": {"version": None}}, 0)] == ["warn"]
  assert [f.severity for f in _doctor.judge_packages({**base, "jax": {"version": None}}, 0)] == ["fail"]
  cpu_jax = _doctor.judge_packages({**base, "jax": {**present, "backend": "cpu"}}, 1)
  assert [f.severity for f in cpu_jax] == ["warn"] and "jax[cuda" in cpu_jax[0].fix
  mismatch = _doctor.judge_packages({**base, "nixl": {**present, "cuda": "12"}}, 1)
  assert [f.fix for f in mismatch] == ["pip install nixl-cu13"]


NVLINK_STATUS = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)
\t Link 0: 26.562 GB/s
\t Link 1: 26.562 GB/s
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)
\t Link 0: <inactive>
"""


def test_gpu_decisions():
  assert _doctor.active_nvlinks(NVLINK_STATUS) == 2
  assert _doctor.active_nvlinks("GPU 0: NVIDIA H200 (UUID: GPU-cccc)\n") == 0
  assert _doctor.judge_gpus(0, [], "", None, {}, None).severity == "ok"
  unseen = _doctor.judge_gpus(0, [], "", 2, {}, None)
  assert unseen.severity == "warn" and "neither torch nor jax" in unseen.what
  one = _doctor.judge_gpus(1, ["NVIDIA H200"], "torch", 1, {}, 0)
  assert one.severity == "ok" and "NVIDIA H200" in one.what
  no_peer = _doctor.judge_gpus(2, ["A", "A"], "torch", 2, {"0->1": False, "1->0": False}, 0)
  assert no_peer.severity == "warn" and "0->1" in no_peer.what


def test_ray_builtins_need_torch_and_more():
  assert _doctor.ray_builtin_usable(torch_cuda=False, nixl_meta=True) == {
      "nixl": True, "gloo": True, "nccl": False, "cuda_ipc": False,
  }
  assert set(_doctor.ray_builtin_usable(True, False)) == set(_doctor.RAY_BUILTIN)


def test_exit_status_and_text():
  findings = [Finding("ok", "a"), Finding("warn", "b", "why b", "fix b")]
  assert _doctor.exit_status(findings) == 0
  assert _doctor.exit_status([*findings, Finding("fail", "c", "why c", "fix c")]) == 1


def test_text_report_of_a_gpu_host():
  # The report's text for a (crafted) two-GPU host whose device READ is emulated.
  read = {"state": "DONE", "gbps": 0.57, "path": {"protocol": "software emulation", "transport": "tcp/lo"}}
  verdict = _doctor.judge_device_read(EMULATED, ReadPath("cuda", "software emulation", "tcp/lo", 6), [])
  report = {
      "versions": {"ray": {"version": "2.60.0"}, "torch": {"version": "2.11.0", "cuda": "13.0"},
                   "nixl": {"version": "1.5.1", "module": "nixl_cu13._api", "cuda": "13"}},
      "ray": {"version": "2.60.0", "tested_range": _ray.version.SUPPORTED_RAY},
      "transports": {"rdt_jax": ["jax_nixl"], "ray_builtin": {"nixl": {"usable": True, "needs": "torch"}}},
      "gpus": {"count": 2, "names": ["NVIDIA H100", "NVIDIA H100"], "peer_access": {"0->1": True, "1->0": True},
               "nvlink": NVLINK_STATUS, "topology": "GPU0\tX\tNV18"},
      "ucx": {"env": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}, "set_by_rdt_jax": {}, "nbytes": MIB16,
              "version": "1.23.0", "reads": {"host": {**read, "gbps": 5.0}, "cuda": read},
              "node_local": {"state": "ok", "gbps": 5.0}},
      "xla_memory": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
      "findings": [dataclasses.asdict(verdict)],
      "exit_status": 1,
  }
  text = _doctor.render_text(report)
  assert "torch      2.11.0  (CUDA 13.0)" in text and "nixl_cu13, CUDA 13 build" in text
  assert "  1: NVIDIA H100" in text and "peer access: 0->1 yes, 1->0 yes" in text
  assert "    \t Link 0: 26.562 GB/s" in text  # nvidia-smi's own output, indented
  assert "    cuda  software emulation over tcp/lo, 0.57 GB/s" in text
  assert "  fail  NIXL READ of GPU memory (torch memory, cuda:0 <- cuda:0): software emulation" in text
  assert text.endswith("1 fail, 0 warn: exit status 1")
