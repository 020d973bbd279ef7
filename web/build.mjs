// Builds the browser peer into dist/ (git-ignored; the node's HTTP edge serves it at /train) and the
// node-side test driver into dist/node/. Run with `npm run build` (after `npm ci`), or `make web`.
import * as esbuild from "esbuild";
import { copyFileSync, existsSync, mkdirSync } from "node:fs";

mkdirSync("dist/node", { recursive: true });
const common = { bundle: true, sourcemap: false, logLevel: "warning", target: "es2022" };
if (existsSync("src/page.ts")) {
  await esbuild.build({ ...common, entryPoints: ["src/page.ts"], outfile: "dist/train.js", format: "esm", platform: "browser", minify: true });
  copyFileSync("src/index.html", "dist/index.html");
}
await esbuild.build({ ...common, entryPoints: ["src/node/interop.ts"], outfile: "dist/node/interop.mjs", format: "esm",
  platform: "node", external: ["bufferutil", "utf-8-validate"],
  banner: { js: "import { createRequire } from 'module'; const require = createRequire(import.meta.url);" } });
