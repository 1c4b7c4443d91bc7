// moeforge_generate: load a moeforge artifact (GQA, contiguous KV cache: the ones with genai_config.json)
// through onnxruntime-genai's C API and generate greedy tokens from given prompt token ids.
//
//   moeforge_generate ARTIFACT_DIR --prompt-ids 1,2,3 [--max-new-tokens 32] [--ignore-eos]
//
// Prints the generated token ids, comma-separated, on one line. Exit codes: 0 ok, 1 runtime error, 2 usage.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

// The onnxruntime-genai C API (ort_genai_c.h of onnxruntime-genai 0.18; the wheel ships the library only):
// just the functions this program calls. Every OgaResult* is an error (nullptr = success).
extern "C" {
struct OgaResult;
struct OgaModel;
struct OgaGeneratorParams;
struct OgaGenerator;
const char* OgaResultGetError(const OgaResult* result);
void OgaDestroyResult(OgaResult* result);
OgaResult* OgaCreateModel(const char* config_path, OgaModel** out);
void OgaDestroyModel(OgaModel* model);
OgaResult* OgaCreateGeneratorParams(const OgaModel* model, OgaGeneratorParams** out);
void OgaDestroyGeneratorParams(OgaGeneratorParams* params);
OgaResult* OgaGeneratorParamsSetSearchNumber(OgaGeneratorParams* params, const char* name, double value);
OgaResult* OgaGeneratorParamsSetSearchBool(OgaGeneratorParams* params, const char* name, bool value);
OgaResult* OgaCreateGenerator(const OgaModel* model, const OgaGeneratorParams* params, OgaGenerator** out);
void OgaDestroyGenerator(OgaGenerator* generator);
OgaResult* OgaGenerator_AppendTokens(OgaGenerator* generator, const int32_t* input_ids, size_t count);
bool OgaGenerator_IsDone(const OgaGenerator* generator);
OgaResult* OgaGenerator_GenerateNextToken(OgaGenerator* generator);
size_t OgaGenerator_GetSequenceCount(const OgaGenerator* generator, size_t index);
const int32_t* OgaGenerator_GetSequenceData(const OgaGenerator* generator, size_t index);
void OgaShutdown();
}

namespace {

// Throws the message of a failed call (and frees its OgaResult).
void check(OgaResult* result, const char* what) {
  if (result == nullptr) return;
  std::string message = std::string(what) + ": " + OgaResultGetError(result);
  OgaDestroyResult(result);
  throw std::runtime_error(message);
}

template <typename T, void (*Destroy)(T*)>
struct Deleter {
  void operator()(T* p) const { Destroy(p); }
};
using Model = std::unique_ptr<OgaModel, Deleter<OgaModel, OgaDestroyModel>>;
using Params = std::unique_ptr<OgaGeneratorParams, Deleter<OgaGeneratorParams, OgaDestroyGeneratorParams>>;
using Generator = std::unique_ptr<OgaGenerator, Deleter<OgaGenerator, OgaDestroyGenerator>>;

struct Options {
  std::string artifact;
  std::vector<int32_t> prompt;
  int max_new_tokens = 32;
  bool ignore_eos = false;
};

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (item.empty()) continue;
    size_t used = 0;
    long value = std::stol(item, &used);
    if (used != item.size() || value < 0 || value > INT32_MAX) throw std::invalid_argument(item);
    ids.push_back(static_cast<int32_t>(value));
  }
  return ids;
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--prompt-ids" && i + 1 < argc) {
      options.prompt = parse_ids(argv[++i]);
    } else if (arg == "--max-new-tokens" && i + 1 < argc) {
      options.max_new_tokens = std::stoi(argv[++i]);
    } else if (arg == "--ignore-eos") {
      options.ignore_eos = true;
    } else if (!arg.empty() && arg[0] != '-' && options.artifact.empty()) {
      options.artifact = arg;
    } else {
      throw std::invalid_argument("unknown or incomplete argument " + arg);
    }
  }
  if (options.artifact.empty() || options.prompt.empty() || options.max_new_tokens < 1)
    throw std::invalid_argument("need ARTIFACT_DIR, --prompt-ids and --max-new-tokens >= 1");
  return options;
}

// Greedy generation: the new token ids (prompt excluded). genai stops at EOS (left out of the sequence)
// unless ignore_eos, which forces max_new_tokens tokens through min_length.
std::vector<int32_t> generate(const Options& options) {
  OgaModel* raw_model = nullptr;
  check(OgaCreateModel(options.artifact.c_str(), &raw_model), "load the model");
  Model model(raw_model);

  OgaGeneratorParams* raw_params = nullptr;
  check(OgaCreateGeneratorParams(model.get(), &raw_params), "create generator params");
  Params params(raw_params);
  const double max_length = static_cast<double>(options.prompt.size() + options.max_new_tokens);
  check(OgaGeneratorParamsSetSearchNumber(params.get(), "max_length", max_length), "set max_length");
  check(OgaGeneratorParamsSetSearchBool(params.get(), "do_sample", false), "set do_sample");
  check(OgaGeneratorParamsSetSearchNumber(params.get(), "batch_size", 1), "set batch_size");
  if (options.ignore_eos)
    check(OgaGeneratorParamsSetSearchNumber(params.get(), "min_length", max_length), "set min_length");

  OgaGenerator* raw_generator = nullptr;
  check(OgaCreateGenerator(model.get(), params.get(), &raw_generator), "create the generator");
  Generator generator(raw_generator);
  check(OgaGenerator_AppendTokens(generator.get(), options.prompt.data(), options.prompt.size()),
        "append the prompt");
  while (!OgaGenerator_IsDone(generator.get()))
    check(OgaGenerator_GenerateNextToken(generator.get()), "generate a token");

  const size_t count = OgaGenerator_GetSequenceCount(generator.get(), 0);
  const int32_t* data = OgaGenerator_GetSequenceData(generator.get(), 0);
  return std::vector<int32_t>(data + options.prompt.size(), data + count);
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse(argc, argv);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "usage: %s ARTIFACT_DIR --prompt-ids 1,2,3 [--max-new-tokens N] [--ignore-eos]\n  %s\n",
                 argv[0], error.what());
    return 2;
  }
  int code = 0;
  try {
    std::vector<int32_t> tokens = generate(options);
    for (size_t i = 0; i < tokens.size(); ++i) std::printf(i ? ",%d" : "%d", tokens[i]);
    std::printf("\n");
  } catch (const std::exception& error) {
    std::fprintf(stderr, "moeforge_generate: %s\n", error.what());
    code = 1;
  }
  OgaShutdown();
  return code;
}
