#!/usr/bin/env node
// Validates rendered manifests (YAML streams, one per argument) against the
// Kubernetes and Prometheus Operator schemas shipped by the npm packages
// kubernetes-models and @kubernetes-models/prometheus-operator (deploy/tools):
//  1. each object through its model's JSON-schema validator (ajv: required
//     fields, types, enums, formats);
//  2. each object compiled by TypeScript against the model's interface, with
//     excess-property checks, so that a misspelt or misplaced field fails
//     (the JSON schemas allow unknown fields).
// An apiVersion/kind with no model fails too. Exit status 1 on any error.
//
//   node deploy/k8s/check_schemas.js RENDERED.yaml...
"use strict";
const fs = require("fs");
const os = require("os");
const path = require("path");
const { execFileSync } = require("child_process");

const TOOLS = path.resolve(__dirname, "..", "tools");
const req = (m) => require(path.join(TOOLS, "node_modules", m));
const yaml = req("js-yaml");

// apiVersion -> module of its models (types: same path + "/<Kind>").
function modulePath(apiVersion) {
  if (apiVersion === "monitoring.coreos.com/v1") {
    return "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";
  }
  if (apiVersion === "v1") return "kubernetes-models/v1";
  if (/^[a-z0-9.]+\/v[0-9a-z]+$/.test(apiVersion)) return `kubernetes-models/${apiVersion}`;
  return null;
}

const errors = [];
const objects = [];
for (const file of process.argv.slice(2)) {
  const docs = yaml.loadAll(fs.readFileSync(file, "utf8")).filter((d) => d != null);
  if (docs.length === 0) errors.push(`${file}: no objects`);
  docs.forEach((doc, i) => {
    const where = `${path.basename(file)}: ${doc.kind}/${(doc.metadata || {}).name}`;
    const mod = modulePath(doc.apiVersion || "");
    let Model;
    try {
      Model = mod && req(mod)[doc.kind];
    } catch (e) {
      Model = undefined;
    }
    if (!Model) {
      errors.push(`${where}: no schema for apiVersion ${doc.apiVersion} kind ${doc.kind}`);
      return;
    }
    try {
      new Model(doc).validate();
    } catch (e) {
      errors.push(`${where}: schema: ${e.message}`);
    }
    objects.push({ where, mod, doc });
  });
}

// TypeScript: one constant per object, typed by its model's interface.
if (objects.length) {
  const dir = fs.mkdtempSync(path.join(TOOLS, "tsc-"));
  try {
    const lines = [];
    const where = [];
    objects.forEach((o, i) => {
      lines.push(`import type { I${o.doc.kind} as T${i} } from "${o.mod}/${o.doc.kind}";`);
    });
    objects.forEach((o, i) => {
      where[lines.length] = o.where;
      lines.push(`export const o${i}: T${i} = ${JSON.stringify(o.doc)};`);
    });
    fs.writeFileSync(path.join(dir, "objects.ts"), lines.join("\n") + "\n");
    fs.writeFileSync(path.join(dir, "tsconfig.json"), JSON.stringify({
      compilerOptions: {
        noEmit: true, strict: true, skipLibCheck: true, types: [],
        module: "commonjs", moduleResolution: "node", target: "es2020",
      },
      files: ["objects.ts"],
    }));
    try {
      execFileSync(process.execPath,
        [path.join(TOOLS, "node_modules", "typescript", "bin", "tsc"), "-p", dir],
        { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
    } catch (e) {
      const out = `${e.stdout || ""}${e.stderr || ""}`.trim();
      for (const line of out.split("\n")) {
        const m = /objects\.ts\((\d+),\d+\): (.*)/.exec(line);
        if (m) errors.push(`${where[Number(m[1]) - 1] || "objects.ts"}: types: ${m[2]}`);
        else if (line.trim()) errors.push(`tsc: ${line.trim()}`);
      }
      if (!out) errors.push(`tsc failed: ${e.message}`);
    }
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

for (const e of errors) console.error(`check_schemas: ${e}`);
if (errors.length) {
  console.error(`check_schemas: FAIL (${errors.length} errors)`);
  process.exit(1);
}
console.log(`check_schemas: ${objects.length} objects valid`);
