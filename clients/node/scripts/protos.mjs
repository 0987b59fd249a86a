// The proto contract lives in ../../protos; this script keeps the package in step with it.
//
//   node scripts/protos.mjs generate   # regenerate the TypeScript types into src/generated (npm run generate)
//   node scripts/protos.mjs check      # exit 1 if src/generated differs from a fresh generation (npm test)
//   node scripts/protos.mjs copy       # copy the .proto into dist/proto, loaded at run time (npm run build)
//
// The generator's options must match LOADER_OPTIONS in src/proto.ts: they decide the shapes of the
// types (camelCase names, 64-bit integers as numbers, enums as strings, defaults, oneof names).

import { execFileSync } from "node:child_process";
import { cpSync, mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, relative } from "node:path";
import { fileURLToPath } from "node:url";

const PACKAGE = dirname(dirname(fileURLToPath(import.meta.url)));
const PROTOS = "../../protos"; // relative, as the generated files quote it in their headers
const PROTO_FILE = "h3/v1/h3.proto";
const GENERATED = join(PACKAGE, "src", "generated");
const GENERATOR_ARGS = [
  "--longs=Number",
  "--enums=String",
  "--defaults",
  "--oneofs",
  "--includeComments",
  "--grpcLib=@grpc/grpc-js",
  "--importFileExtension=.js",
];

function generate(outDir) {
  const bin = join(PACKAGE, "node_modules", ".bin", "proto-loader-gen-types");
  execFileSync(bin, [...GENERATOR_ARGS, "-I", PROTOS, "-O", outDir, PROTO_FILE], { cwd: PACKAGE, stdio: "inherit" });
}

function files(root, dir = root) {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const path = join(dir, entry.name);
    return entry.isDirectory() ? files(root, path) : [relative(root, path)];
  });
}

function check() {
  const fresh = mkdtempSync(join(tmpdir(), "h3d-generated-"));
  try {
    generate(fresh);
    const want = new Set(files(fresh));
    const have = new Set(files(GENERATED));
    const stale = [...new Set([...want, ...have])]
      .filter((name) => !want.has(name) || !have.has(name) || !sameFile(join(fresh, name), join(GENERATED, name)))
      .sort();
    if (stale.length > 0) {
      console.error(`src/generated is stale (${stale.join(", ")}): run \`npm run generate\``);
      return 1;
    }
    console.log(`src/generated is current (${want.size} files)`);
    return 0;
  } finally {
    rmSync(fresh, { recursive: true, force: true });
  }
}

function sameFile(a, b) {
  return readFileSync(a).equals(readFileSync(b));
}

function copy() {
  cpSync(join(PACKAGE, PROTOS, PROTO_FILE), join(PACKAGE, "dist", "proto", PROTO_FILE));
  return 0;
}

const commands = {
  generate() {
    rmSync(GENERATED, { recursive: true, force: true });
    generate(GENERATED);
    console.log(`generated ${files(GENERATED).length} files under src/generated`);
    return 0;
  },
  check,
  copy,
};

const command = commands[process.argv[2]];
if (command === undefined) {
  console.error("usage: node scripts/protos.mjs generate|check|copy");
  process.exit(2);
}
process.exit(command());
