"""The report's look: its stylesheet, its few lines of script, and the colour of each outcome (CSS classes
the SVG charts use, so a chart is markup only)."""

from __future__ import annotations

from collections.abc import Mapping

COLOURS: Mapping[str, str] = {
    "complete": "#3b75af",
    "pick": "#1a9850",
    "default": "#e8710a",
    "front": "#3b75af",
    "infeasible": "#9aa5b1",
    "oom": "#d62728",
    "kv_too_small": "#9467bd",
    "invalid_config": "#8c564b",
    "start_timeout": "#e377c2",
    "start_failed": "#525252",
    "crashed_under_load": "#b8860b",
    "predicted_infeasible": "#a0a0a0",
    "slo_unreachable": "#17a2b8",
    "unmeasurable": "#6c757d",
    "repeat": "#7fb2e5",
    "given back": "#444444",
    "running": "#2ca02c",
    "queued": "#bbbbbb",
    "pass": "#1a9850",
    "fail": "#d62728",
    "saturation": "#8250df",
}
CSS = """
:root{--fg:#1f2328;--muted:#59636e;--line:#d1d9e0;--bg:#fff;--soft:#f6f8fa;--accent:#1a9850}
*{box-sizing:border-box}
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg);
margin:0 auto;max-width:1120px;padding:20px 28px 60px}
h1{font-size:24px;margin:0 0 2px}h2{font-size:19px;margin:34px 0 8px;border-bottom:1px solid var(--line);
padding-bottom:4px}h3{font-size:15px;margin:14px 0 6px}
p{margin:6px 0}.sub,.note-text{color:var(--muted)}.small{font-size:13px}
code,pre{font:13px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre{background:var(--soft);border:1px solid var(--line);border-radius:6px;padding:10px 12px;overflow-x:auto;
white-space:pre-wrap;word-break:break-all;margin:6px 0}
nav{margin:14px 0 0;font-size:13px}nav a{margin-right:12px;color:var(--muted)}
a{color:#0969da;text-decoration:none}a:hover{text-decoration:underline}
.answer{border:2px solid var(--accent);border-radius:10px;padding:14px 18px;margin-top:14px;
background:#f4fbf6}
.answer.none{border-color:#d62728;background:#fdf3f3}
.answer h2{border:0;margin:0 0 4px;padding:0}
.headline{font-size:16px;font-weight:600}
.kpis{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.kpi{background:#fff;border:1px solid var(--line);border-radius:8px;padding:8px 12px;min-width:150px}
.kpi .v{font-size:22px;font-weight:700}.kpi .u{color:var(--muted);margin-left:3px}
.kpi .l{display:block;font-size:12px;color:var(--muted)}.kpi .s{display:block;font-size:12px}
.ok{color:#1a7f37}.bad{color:#cf222e}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border-bottom:1px solid var(--line);padding:3px 8px;text-align:left;vertical-align:top}
th{background:var(--soft);font-weight:600}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
tr.changed td{background:#fff8c5}tr.pick td{background:#e6f4ea}tr.base td{background:#fff1e5}
.grid2{display:flex;flex-wrap:wrap;gap:18px}
.legend{font-size:12px;color:var(--muted);margin:2px 0 4px}.legend span{margin-right:12px;white-space:nowrap}
.sw{vertical-align:-1px;margin-right:3px}
.bars{font-size:13px}.bar{display:flex;align-items:center;margin:2px 0}
.bar .k{width:190px}.bar .t{height:14px;border-radius:2px;margin-right:6px}
.bar .neg{background:#d62728}.bar .pos{background:#1a9850}.bar .flat{background:#9aa5b1}
svg text{font:11px system-ui,sans-serif;fill:#444}svg .axis{font-size:12px;fill:#222}
svg .note{font-size:11px;fill:#555}
svg .plot{fill:#fcfcfd;stroke:#c9d1d9}svg .grid{stroke:#eceff2}
svg .pt{stroke:#fff;stroke-width:1}svg .ln{fill:none;stroke-width:2}svg .ln.dash{stroke-dasharray:6 3}
svg .rej{fill:#fff !important;stroke-width:1.6}
svg .slo{stroke:#cf222e;stroke-dasharray:5 3;stroke-width:1.3}
svg .base{stroke:#e8710a;stroke-dasharray:4 3;stroke-width:1.3}
svg .err{stroke:#3b75af;stroke-width:1.4;opacity:.55}svg .est{stroke:#3b75af;stroke-width:5;opacity:.3}
details>summary{cursor:pointer;color:#0969da;margin:6px 0}
.strip td{padding:1px 6px}.strip svg{display:block}
button{font:12px system-ui,sans-serif;padding:3px 10px;border:1px solid var(--line);border-radius:5px;
background:#fff;cursor:pointer}
footer{margin-top:40px;font-size:12px;color:var(--muted)}
@media print{nav,button{display:none}body{max-width:none}}
"""

JS = """
(function(){
  var copy=document.getElementById('copy-serve');
  if(copy){copy.addEventListener('click',function(){
    var text=document.getElementById('serve-line').textContent;
    if(navigator.clipboard){navigator.clipboard.writeText(text).then(function(){copy.textContent='Copied';},
      function(){copy.textContent='Select the line to copy';});}
  });}
  function reveal(){
    var id=decodeURIComponent(location.hash.slice(1));var el=id&&document.getElementById(id);
    if(!el){return;}
    for(var p=el.parentElement;p;p=p.parentElement){if(p.tagName==='DETAILS'){p.open=true;}}
    el.scrollIntoView();
  }
  window.addEventListener('hashchange',reveal);reveal();
})();
"""


def colour_css() -> str:
    """The CSS rules that colour each outcome's marks, lines and bars."""
    rules = []
    for name, colour in COLOURS.items():
        klass = css_class(name)
        rules.append(
            f"svg .{klass}{{fill:{colour};stroke:{colour}}}svg .ln.{klass}{{fill:none}}"
            f"svg .pt.{klass}{{stroke:#fff}}svg .pt.rej.{klass}{{stroke:{colour}}}"
            f".t.{klass}{{background:{colour}}}"
        )
    return "".join(rules)


def css_class(name: str) -> str:
    """The CSS class of an outcome or role (``oom`` → ``c-oom``)."""
    return "c-" + name.replace(" ", "-").replace("_", "-")
