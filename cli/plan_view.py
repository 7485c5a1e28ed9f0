"""How ``zattera apps apply`` shows its plan (what it would do with ``--dry-run``, what it did without): one
line per object (``+`` create, ``~`` change, ``-`` remove, ``!`` pending, blank unchanged) and, under each,
the fields that change — like ``terraform plan``."""

from __future__ import annotations

import json
from typing import Any

from rich.markup import escape

from cli import render
from cli.apply import CREATE, DELETE, PENDING, UNCHANGED, UPDATE, ApplyResult, PlanItem

_MARK = {CREATE: "[green]+[/]", UPDATE: "[yellow]~[/]", DELETE: "[red]-[/]", PENDING: "[yellow]![/]", UNCHANGED: " "}


def _value(value: Any) -> str:
    return "(none)" if value is None else json.dumps(value, ensure_ascii=False)


def _line(item: PlanItem, width: int) -> str:
    subject = f"{item.kind} {item.name}"
    note = f"  ({item.note})" if item.note else ""
    return f"{_MARK[item.action]} {escape(subject):<{width}}  {item.action}{escape(note)}"


def print_plan(result: ApplyResult, *, dry_run: bool) -> None:
    width = max((len(f"{i.kind} {i.name}") for i in result.items), default=0)
    for item in result.items:
        render.out.print(_line(item, width), soft_wrap=True)
        for change in item.changes:
            if change.sensitive:
                text = f"{change.field}: (hidden value {'set' if item.action == CREATE else 'changed'})"
            elif item.action == CREATE:
                text = f"{change.field}: {_value(change.new)}"
            else:
                text = f"{change.field}: {_value(change.old)} → {_value(change.new)}"
            render.out.print(f"      {escape(text)}", soft_wrap=True, highlight=False)
    counts = result.counts()
    if dry_run:
        summary = (
            f"Plan: {counts[CREATE]} to create, {counts[UPDATE]} to change, {counts[DELETE]} to remove,"
            f" {counts[UNCHANGED]} unchanged. Nothing was written (--dry-run)."
        )
    else:
        summary = (
            f"Applied: {counts[CREATE]} created, {counts[UPDATE]} changed, {counts[DELETE]} removed,"
            f" {counts[UNCHANGED]} unchanged."
        )
    render.out.print(summary, soft_wrap=True)
