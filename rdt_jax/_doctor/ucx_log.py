"""UCX's log: the variables that make UCX print its protocol tables, and the
reading of them (`parse_proto_tables`), of the path a READ took (`read_path`),
of UCX's errors and of its version.

The NIXL wheels ship no `ucx_info`: the tables a loopback READ makes UCX log
with `UCX_PROTO_INFO=used` are how the doctor learns which protocol and
transport a READ used.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Final

#: What the loopback's children add to their environment (with `UCX_LOG_FILE`):
#: UCX then logs its version and, as each worker closes, the protocols it used.
UCX_LOG_ENV: Final = {"UCX_LOG_LEVEL": "info", "UCX_PROTO_INFO": "used"}


@dataclasses.dataclass(frozen=True)
class ProtoRow:
  """One row of a UCX protocol table: how often (`count`, -1 where the table
  has no Count column) a message size `range` used protocol `description`
  (`zero-copy`, `software emulation`, ...) over `config` (`cma/memory`,
  `tcp/lo`, `cuda_ipc/cuda`, ...)."""

  count: int
  range: str
  description: str
  config: str


@dataclasses.dataclass(frozen=True)
class ProtoTable:
  """One protocol table: `context` ("probe-initiator intra-node cfg#2"),
  `title` ("remote memory read by ucp_get*(multi) into host memory from
  host"), the operation ("remote memory read") and the memory kinds on
  this side and the remote one ("host", "cuda"; None if not said)."""

  context: str
  title: str
  operation: str
  local_memory: str | None
  remote_memory: str | None
  rows: tuple[ProtoRow, ...]


_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\[[^\]]*\]\s*")
_READ_TITLE = re.compile(r"^(?P<op>.+?) by \S+ into (?P<local>\S+)(?: memory)? from (?P<remote>\S+)")
_WRITE_TITLE = re.compile(r"^(?P<op>.+?) by \S+ from (?P<local>\S+)(?: memory)? to (?P<remote>\S+)")
_OTHER_TITLE = re.compile(r"^(?P<op>.+?) by \S+(?: from (?P<local>\S+))?")


def _memory_kind(token: str | None) -> str | None:
  """"cuda/GPU0" -> "cuda", "host" -> "host"."""
  return token.split("/")[0].lower() if token else None


def _title_parts(title: str) -> tuple[str, str | None, str | None]:
  for pattern in (_READ_TITLE, _WRITE_TITLE, _OTHER_TITLE):
    m = pattern.match(title)
    if m:
      groups = m.groupdict()
      return m.group("op"), _memory_kind(groups.get("local")), _memory_kind(groups.get("remote"))
  return title, None, None


def _cells(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_proto_tables(text: str) -> list[ProtoTable]:
  """Every protocol table in a UCX log (`UCX_PROTO_INFO=used` or `y`).

  A table is a context line and a title line, each one cell wide, then a
  header row naming the columns (Count, Range, Description, Config) and the
  rows; lines may carry UCX's `[time] [host:pid:thread]` prefix. Columns are
  matched by their header name, so a table without a Count column parses
  with `count=-1`. Lines that are not table lines are ignored.
  """
  tables: list[ProtoTable] = []
  headings: list[str] = []
  header: list[str] | None = None
  rows: list[ProtoRow] = []

  def close() -> None:
    nonlocal header, rows
    if header is not None and len(headings) >= 2:
      context, title = headings[-2], headings[-1]
      op, local, remote = _title_parts(title)
      tables.append(ProtoTable(context, title, op, local, remote, tuple(rows)))
    header, rows = None, []

  for raw in text.splitlines():
    line = _LOG_PREFIX.sub("", raw).strip()
    if not line.startswith(("|", "+")) or line.startswith("+"):
      continue
    cells = _cells(line)
    if len(cells) == 1:
      if header is not None:
        close()
        headings.clear()
      headings.append(cells[0])
    elif {"Range", "Description", "Config"} <= set(cells):
      close()
      header = cells
    elif header is not None and len(cells) == len(header):
      row = dict(zip(header, cells))
      count = row.get("Count", "-1")
      rows.append(ProtoRow(
          int(count) if count.lstrip("-").isdigit() else -1,
          row.get("Range", ""), row.get("Description", ""), row.get("Config", ""),
      ))
  close()
  return tables


@dataclasses.dataclass(frozen=True)
class ReadPath:
  """How UCX moved a READ into `memory` ("host", "cuda") from the same kind:
  the protocol descriptions and transport configs of the rows it used (all
  rows where the table has no counts), each joined with "; "."""

  memory: str
  protocol: str
  transport: str
  count: int

  @property
  def emulated(self) -> bool:
    """True if UCX emulated the READ in software (messages, not a one-sided copy)."""
    return "emulation" in self.protocol

  @property
  def over_tcp(self) -> bool:
    """True if the bytes went over TCP (loopback on one host)."""
    return any(t.strip().startswith("tcp") for t in self.transport.split(";"))


def read_path(tables: list[ProtoTable], memory: str) -> ReadPath | None:
  """The `ReadPath` of READs into `memory` from `memory` in `tables`, or None
  if UCX logged no such table. Rows of several tables (one per endpoint
  configuration) are combined; rows with a zero count are left out."""
  rows = [
      r for t in tables
      if t.operation == "remote memory read" and t.local_memory == memory and t.remote_memory == memory
      for r in t.rows
  ]
  used = [r for r in rows if r.count != 0]
  if not used:
    return None

  def joined(values: list[str]) -> str:
    return "; ".join(dict.fromkeys(v for v in values if v))

  return ReadPath(
      memory, joined([r.description for r in used]), joined([r.config for r in used]),
      sum(max(r.count, 0) for r in used),
  )


def ucx_errors(text: str) -> list[str]:
  """UCX's ERROR and WARN messages in a log, without their prefixes, each once."""
  found = re.findall(r"UCX\s+(?:ERROR|WARN)\s+(.*)$", text, re.MULTILINE)
  return list(dict.fromkeys(m.strip() for m in found))


def ucx_version(text: str) -> str | None:
  """The UCX version a log says was loaded ("1.23.0"), or None."""
  m = re.search(r"UCX\s+INFO\s+Version (\S+)", text)
  return m.group(1) if m else None
