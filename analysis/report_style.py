"""The report page's stylesheet (report.html: tables, figures, the findings grid, warnings)."""

REPORT_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1em 1.5em;
color:#222;max-width:1400px}h1{font-size:1.3em;margin:.2em 0}h2{font-size:1.15em}h3{font-size:1em;margin:.4em 0}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.2em .5em;text-align:right}th{background:#f2f2f2}
td.l,th{text-align:left}code{font-size:.9em}p.sum{margin:.2em 0;color:#444;font-size:.85em}
img{max-width:100%;border:1px solid #eee}figure{margin:1em 0}
figcaption{color:#555;max-width:75em}.note{color:#555}dl{display:grid;
grid-template-columns:max-content auto;gap:.2em 1em}dt{font-weight:bold}
#findings .models{display:grid;grid-template-columns:repeat(auto-fit,minmax(640px,1fr));gap:.2em 1.5em}
#findings .models>*{min-width:0;overflow-x:auto}#findings table{font-size:.78em}
#findings table.ranges td{white-space:nowrap;padding:.1em .35em}#findings td{text-align:left}#findings small{color:#555}
#findings p.warn{background:#fff3e0;border-left:4px solid #ff7f0e;margin:.2em 0;padding:.15em .5em;font-size:.8em}
#findings p.note{font-size:.8em}#findings p.headline{font-size:.85em;margin:.2em 0}
#findings p.flags{font-size:.8em;color:#a04000;margin:.2em 0}#findings caption{font-size:.9em;text-align:left;color:#444}
p.partial{background:#fdecea;border-left:4px solid #d62728;padding:.3em .6em;font-weight:bold}
span.grid{font-weight:normal;color:#666;font-size:.85em}
details{margin:1em 0}summary{font-weight:bold;cursor:pointer;font-size:1.1em}"""
