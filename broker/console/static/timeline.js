// The timeline's chart (uPlot): decisions per interval by result, policy markers as lines.
(function () {
  "use strict";
  const COLORS = { allow: "#2e7d32", partial: "#ef6c00", deny: "#c62828", error: "#6a1b9a" };
  const MARKER = { policy_change: "#1565c0", policy_reload_failed: "#c62828" };

  function drawMarkers(u, markers) {
    const ctx = u.ctx;
    ctx.save();
    ctx.lineWidth = 2;
    ctx.setLineDash([6, 4]);
    for (const m of markers) {
      const x = u.valToPos(m.t, "x", true);
      if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
      ctx.strokeStyle = MARKER[m.type] || "#555";
      ctx.beginPath();
      ctx.moveTo(x, u.bbox.top);
      ctx.lineTo(x, u.bbox.top + u.bbox.height);
      ctx.stroke();
    }
    ctx.restore();
  }

  function draw() {
    const element = document.getElementById("chart");
    if (element === null || element.dataset.drawn) return;
    element.dataset.drawn = "1";
    // the page carries the chart's data (the records are read once per opening); the same
    // JSON is served at /console/api/timeline for scripts
    new Promise((resolve) => resolve(JSON.parse(element.dataset.timeline)))
      .then((data) => {
        const results = Object.keys(COLORS).filter((r) => r !== "partial" || data.totals.partial > 0);
        const options = {
          width: Math.max(element.clientWidth, 320),
          height: 280,
          scales: { x: { time: true } },
          series: [{}].concat(results.map((r) => ({ label: r, stroke: COLORS[r], width: 2 }))),
          hooks: { draw: [(u) => drawMarkers(u, data.markers)] },
        };
        // eslint-disable-next-line no-new
        new uPlot(options, [data.x].concat(results.map((r) => data.series[r])), element);
        element.dataset.points = String(data.x.length);
      })
      .catch((error) => {
        element.textContent = `The chart's data could not be read: ${error.message}`;
      });
  }

  document.addEventListener("DOMContentLoaded", draw);
  document.addEventListener("htmx:afterSettle", draw);
})();
