"""The report `k3 doctor` fills (k3.doctor): its sections, the problems found (blocking
or warnings), the commands to run next, and the same as a dict for --json. Its own
module so the checks that live outside k3.doctor (k3.doctor_model) can fill it without
importing k3.doctor back."""

from __future__ import annotations

from dataclasses import dataclass, field

from .version import __version__


@dataclass
class Report:
    sections: list = field(default_factory=list)  # (title, [lines])
    blocking: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    next_steps: list = field(default_factory=list)  # (command, why)
    data: dict = field(default_factory=dict)

    def section(self, title: str) -> list:
        lines: list = []
        self.sections.append((title, lines))
        return lines

    def render(self) -> str:
        out = [f"k3 doctor (k3 {__version__})"]
        for title, lines in self.sections:
            out.append("")
            out.append(title)
            out += [f"  {ln}" for ln in lines]
        out.append("")
        if self.blocking or self.warnings:
            out.append("problems")
            out += [f"  BLOCKING: {m}" for m in self.blocking]
            out += [f"  warning: {m}" for m in self.warnings]
        else:
            out.append("problems: none")
        if self.next_steps:
            out.append("")
            out.append("next")
            for cmd, why in self.next_steps:
                out.append(f"  {cmd}")
                if why:
                    out.append(f"      # {why}")
        return "\n".join(out)

    def as_dict(self) -> dict:
        return {"k3_version": __version__, "blocking": self.blocking, "warnings": self.warnings,
                "next": [c for c, _ in self.next_steps], "sections": {t: ls for t, ls in self.sections},
                **self.data}
