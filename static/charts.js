// A small line chart on a <canvas>: named series of numbers, newest last, auto-scaled y axis.
// No dependencies. Usage: const c = new LineChart(canvas, {maxPoints: 120}); c.push({a: 1, b: 2}); c.draw();
"use strict";

const PALETTE = ["#2f6fde", "#d64545", "#1f9d55", "#d08a00", "#8e44ad", "#16a2b8", "#6b7385", "#e67e22"];

class LineChart {
  constructor(canvas, options = {}) {
    this.canvas = canvas;
    this.maxPoints = options.maxPoints || 120;
    this.format = options.format || ((v) => formatNumber(v));
    this.fixedMax = options.max;  // e.g. 100 for percentages
    this.series = new Map();  // name -> array of numbers|null, all the same length
    this.length = 0;
  }

  push(values) {
    for (const name of Object.keys(values)) {
      if (!this.series.has(name)) this.series.set(name, new Array(this.length).fill(null));
    }
    for (const [name, points] of this.series) {
      const v = values[name];
      points.push(v === undefined || v === null || Number.isNaN(v) ? null : v);
      if (points.length > this.maxPoints) points.shift();
    }
    this.length = Math.min(this.length + 1, this.maxPoints);
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (!width || !height) return;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const left = 44, right = 6, top = 16, bottom = 6;
    const plotW = width - left - right, plotH = height - top - bottom;
    let max = this.fixedMax || 0;
    for (const points of this.series.values()) for (const v of points) if (v !== null && v > max) max = v;
    if (!this.fixedMax) max = niceCeiling(max);
    ctx.font = "10px system-ui, sans-serif";
    ctx.strokeStyle = "#eceef2";
    ctx.fillStyle = "#8a91a2";
    ctx.lineWidth = 1;
    for (let i = 0; i <= 2; i++) {
      const y = top + plotH - (plotH * i) / 2;
      ctx.beginPath(); ctx.moveTo(left, y + 0.5); ctx.lineTo(width - right, y + 0.5); ctx.stroke();
      ctx.textAlign = "right"; ctx.textBaseline = "middle";
      ctx.fillText(this.format((max * i) / 2), left - 4, y);
    }
    let index = 0, legendX = left;
    for (const [name, points] of this.series) {
      const color = PALETTE[index++ % PALETTE.length];
      ctx.strokeStyle = color; ctx.lineWidth = 1.6; ctx.beginPath();
      let pen = false;
      points.forEach((v, i) => {
        if (v === null) { pen = false; return; }
        const x = left + (this.maxPoints <= 1 ? 0 : (plotW * (i + this.maxPoints - points.length)) / (this.maxPoints - 1));
        const y = top + plotH - (max > 0 ? (plotH * v) / max : 0);
        if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
        pen = true;
      });
      ctx.stroke();
      const last = [...points].reverse().find((v) => v !== null);
      const label = `${name} ${last === undefined ? "–" : this.format(last)}`;
      ctx.fillStyle = color; ctx.textAlign = "left"; ctx.textBaseline = "top";
      ctx.fillRect(legendX, 3, 8, 8);
      ctx.fillStyle = "#3b4252";
      ctx.fillText(label, legendX + 11, 2);
      legendX += ctx.measureText(label).width + 22;
    }
    if (!this.series.size) {
      ctx.fillStyle = "#a0a6b4"; ctx.textAlign = "center"; ctx.textBaseline = "middle";
      ctx.fillText("no data yet", left + plotW / 2, top + plotH / 2);
    }
  }
}

function niceCeiling(v) {
  if (v <= 0) return 1;
  const exp = Math.pow(10, Math.floor(Math.log10(v)));
  for (const step of [1, 2, 2.5, 5, 10]) if (v <= step * exp) return step * exp;
  return 10 * exp;
}

function formatNumber(v) {
  if (v === null || v === undefined) return "–";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return v.toFixed(1).replace(/\.0$/, "");
  if (a === 0) return "0";
  return v.toFixed(3).replace(/0+$/, "");
}

window.LineChart = LineChart;
window.formatNumber = formatNumber;
